//! The fixed newstyle handshake as a state machine: bytes from the client go in through
//! [`Handshake::handle_input`], bytes for the client come out of [`Handshake::poll_transmit`], and
//! [`Handshake::poll_outcome`] tells when option haggling is over and how.
//!
//! Memory is bounded whatever the client sends: option data is read only up to
//! [`OPTION_DATA_BYTES_MAX`]; longer (or unknown) options are skipped as they stream past.
//!
//! With [`HandshakeConfig::tls`] the server is in the spec's FORCEDTLS mode: before
//! `NBD_OPT_STARTTLS` every option but `NBD_OPT_ABORT` gets `NBD_REP_ERR_TLS_REQD`
//! (`NBD_OPT_EXPORT_NAME`, which cannot be refused, ends the connection). After acknowledging
//! STARTTLS the handshake consumes nothing until the caller has run the TLS handshake and said
//! so ([`Handshake::tls_established`]); whatever was negotiated before is forgotten.

use crate::limits::{
    BLOCK_SIZE_MAX_BYTES, BLOCK_SIZE_MIN_BYTES, BLOCK_SIZE_PREFERRED_BYTES, OPTION_DATA_BYTES_MAX, STRING_BYTES_MAX,
};
use crate::transmission::Transmission;
use crate::wire::*;
use crate::FatalError;

/// The metadata context ID we hand out for `base:allocation` (the only context we support).
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;
const BASE_ALLOCATION: &str = "base:allocation";

/// One export the server offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// Name the client asks for; the empty name is the spec's "default export".
    pub name: String,
    pub size_bytes: u64,
    /// Human-readable text for `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`; empty for none.
    pub description: String,
    /// Advertised read-only (`NBD_FLAG_READ_ONLY`, no trim or write-zeroes): writes, trims
    /// and write-zeroes are refused with `EPERM` before they reach the backend.
    pub read_only: bool,
}

/// Where the handshake looks exports up. Asked afresh for every option, so exports may come and
/// go between connections and during a handshake.
pub trait Exports {
    /// Every export, in the order `NBD_OPT_LIST` shows them.
    fn list(&self) -> Vec<ExportInfo>;

    /// The export with exactly this name.
    fn find(&self, name: &str) -> Option<ExportInfo> {
        self.list().into_iter().find(|export| export.name == name)
    }

    /// The client asks to enter the transmission phase on `export` (`NBD_OPT_GO` or
    /// `NBD_OPT_EXPORT_NAME`), which `find` just returned. `Err(reason)` refuses it: the client
    /// gets `NBD_REP_ERR_UNKNOWN` with the reason and may try another option (after
    /// `NBD_OPT_EXPORT_NAME`, which has no error reply, the session ends). `Ok` opens it: the
    /// handshake ends in the transmission phase on that export, and whoever drives the
    /// handshake owns the opening from then on (it counts the connection until it ends, say).
    fn open(&self, _export: &ExportInfo) -> Result<(), String> {
        Ok(())
    }

    /// What a client that asks for `name`, which `find` did not find, is told with
    /// `NBD_REP_ERR_UNKNOWN`: "no such export", unless the server knows why (an export being
    /// deleted, say).
    fn unknown(&self, _name: &str) -> String {
        NO_SUCH_EXPORT.to_string()
    }
}

/// What a client that asks for an export nobody knows anything of is told.
pub const NO_SUCH_EXPORT: &str = "no such export";

impl Exports for [ExportInfo] {
    fn list(&self) -> Vec<ExportInfo> {
        self.to_vec()
    }

    fn find(&self, name: &str) -> Option<ExportInfo> {
        self.iter().find(|export| export.name == name).cloned()
    }
}

impl Exports for Vec<ExportInfo> {
    fn list(&self) -> Vec<ExportInfo> {
        self.clone()
    }

    fn find(&self, name: &str) -> Option<ExportInfo> {
        self.as_slice().find(name)
    }
}

/// What the caller decides about every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeConfig {
    /// Advertise `NBD_FLAG_CAN_MULTI_CONN`: the backend makes a flush (and FUA) cover writes
    /// completed on every connection to the export.
    pub multi_conn: bool,
    /// TLS is required (FORCEDTLS): the caller can run a TLS handshake when asked.
    pub tls: bool,
}

/// How option haggling ended.
#[derive(Debug)]
pub enum HandshakeOutcome {
    /// `NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME` succeeded: the transmission phase begins with the
    /// byte after the last one consumed.
    Transmission(Transmission),
    /// The client sent `NBD_OPT_ABORT` (acknowledged); close the connection.
    Aborted,
    /// The client broke the protocol; close the connection without sending more.
    Fatal(FatalError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    ClientFlags,
    OptionHeader,
    /// Waiting for all `length` bytes of a known option's data (length is bounded).
    OptionData {
        option: u32,
        length: u32,
    },
    /// Letting `remaining` bytes of an option stream past unbuffered.
    Skip {
        option: u32,
        remaining: u32,
    },
    /// STARTTLS was acknowledged: the caller runs the TLS handshake next.
    AwaitingTls,
    Done,
}

/// Server side of the fixed newstyle handshake.
#[derive(Debug)]
pub struct Handshake {
    config: HandshakeConfig,
    state: State,
    output: Vec<u8>,
    outcome: Option<HandshakeOutcome>,
    client_no_zeroes: bool,
    structured_replies: bool,
    /// Export name of the last successful `NBD_OPT_SET_META_CONTEXT` that selected
    /// `base:allocation`.
    meta_context_export: Option<String>,
    /// TLS is established on the connection.
    tls_active: bool,
}

impl Handshake {
    /// A handshake whose greeting is already waiting in [`Handshake::poll_transmit`].
    pub fn new(config: HandshakeConfig) -> Handshake {
        let mut output = Vec::with_capacity(18);
        put_u64(&mut output, NBDMAGIC);
        put_u64(&mut output, IHAVEOPT);
        put_u16(&mut output, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        Handshake {
            config,
            state: State::ClientFlags,
            output,
            outcome: None,
            client_no_zeroes: false,
            structured_replies: false,
            meta_context_export: None,
            tls_active: false,
        }
    }

    /// Whether the caller must now run the server side of a TLS handshake (once everything
    /// [`Handshake::poll_transmit`] gave is sent), then call [`Handshake::tls_established`].
    /// Bytes the client sent after STARTTLS and before TLS are an attack (plaintext injected
    /// ahead of the handshake): drop the connection rather than use them.
    pub fn wants_tls(&self) -> bool {
        self.state == State::AwaitingTls
    }

    /// TLS is up: option haggling goes on, from scratch, inside it.
    pub fn tls_established(&mut self) {
        assert_eq!(self.state, State::AwaitingTls, "no STARTTLS was acknowledged");
        self.state = State::OptionHeader;
        self.tls_active = true;
        self.structured_replies = false;
        self.meta_context_export = None;
        self.assert_invariants();
    }

    /// Feeds bytes received from the client; returns how many were consumed. Unconsumed bytes
    /// must be offered again, with more appended. Once [`Handshake::poll_outcome`] has something,
    /// nothing more is consumed: the rest belongs to the transmission phase.
    ///
    /// Consumes at least one byte whenever `input` holds [`crate::HANDSHAKE_INPUT_BYTES_MAX`]
    /// bytes or more and the handshake is not over.
    pub fn handle_input(&mut self, input: &[u8], exports: &(impl Exports + ?Sized)) -> usize {
        let mut consumed = 0;
        loop {
            let rest = &input[consumed..];
            match self.state {
                State::Done | State::AwaitingTls => break,
                State::ClientFlags => {
                    let Some(flags) = Reader::new(rest).u32() else {
                        break;
                    };
                    consumed += 4;
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        self.finish(HandshakeOutcome::Fatal(FatalError::ClientFlags(flags)));
                        break;
                    }
                    // Clients that omit FLAG_C_FIXED_NEWSTYLE only ever send NBD_OPT_EXPORT_NAME,
                    // which both styles treat alike, so we need not tell them apart.
                    self.client_no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    self.state = State::OptionHeader;
                }
                State::OptionHeader => {
                    let mut reader = Reader::new(rest);
                    let (Some(magic), Some(option), Some(length)) = (reader.u64(), reader.u32(), reader.u32()) else {
                        break;
                    };
                    consumed += OPTION_HEADER_BYTES;
                    if magic != IHAVEOPT {
                        self.finish(HandshakeOutcome::Fatal(FatalError::OptionMagic(magic)));
                        break;
                    }
                    if option == OPT_EXPORT_NAME && self.tls_required() {
                        self.finish(HandshakeOutcome::Fatal(FatalError::TlsRequired));
                        break;
                    }
                    if option == OPT_EXPORT_NAME && length as usize > STRING_BYTES_MAX {
                        // NBD_OPT_EXPORT_NAME cannot be answered with an error.
                        self.finish(HandshakeOutcome::Fatal(FatalError::ExportName));
                        break;
                    }
                    let buffered = option_is_known(option) && option != OPT_ABORT && length <= OPTION_DATA_BYTES_MAX;
                    self.state = if buffered {
                        State::OptionData { option, length }
                    } else {
                        State::Skip { option, remaining: length }
                    };
                }
                State::OptionData { option, length } => {
                    let length = length as usize;
                    if rest.len() < length {
                        break;
                    }
                    consumed += length;
                    self.state = State::OptionHeader;
                    self.handle_option(option, &rest[..length], exports);
                    if self.state == State::AwaitingTls {
                        break;
                    }
                }
                State::Skip { option, remaining } => {
                    let skipped = rest.len().min(remaining as usize);
                    consumed += skipped;
                    let remaining = remaining - skipped as u32;
                    if remaining > 0 {
                        self.state = State::Skip { option, remaining };
                        break;
                    }
                    self.state = State::OptionHeader;
                    self.handle_skipped_option(option);
                }
            }
        }
        self.assert_invariants();
        consumed
    }

    /// Bytes to send to the client, if any (the whole backlog at once).
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        if self.output.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.output))
        }
    }

    /// How the handshake ended, once it has: it comes with the last reply. Send everything
    /// [`Handshake::poll_transmit`] gives before reading requests (what must hold before the
    /// client hears the end, such as counting the connection, goes before that send).
    pub fn poll_outcome(&mut self) -> Option<HandshakeOutcome> {
        self.outcome.take()
    }

    /// Whether the handshake is over (its outcome may already have been taken).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    pub fn assert_invariants(&self) {
        match self.state {
            State::OptionData { option, length } => {
                assert!(length <= OPTION_DATA_BYTES_MAX);
                assert!(option_is_known(option) && option != OPT_ABORT);
            }
            State::Skip { .. } | State::ClientFlags | State::OptionHeader => {
                assert!(self.outcome.is_none())
            }
            State::AwaitingTls => {
                assert!(self.outcome.is_none() && self.config.tls && !self.tls_active);
                assert!(!self.structured_replies && self.meta_context_export.is_none());
            }
            State::Done => {}
        }
        if self.meta_context_export.is_some() {
            assert!(self.structured_replies);
        }
    }

    fn finish(&mut self, outcome: HandshakeOutcome) {
        assert!(self.state != State::Done, "handshake finished twice");
        self.state = State::Done;
        self.outcome = Some(outcome);
    }

    /// FORCEDTLS and TLS not up yet.
    fn tls_required(&self) -> bool {
        self.config.tls && !self.tls_active
    }

    fn handle_skipped_option(&mut self, option: u32) {
        if option == OPT_ABORT {
            // The spec asks us to ignore any data sent with NBD_OPT_ABORT.
            self.reply(option, REP_ACK, &[]);
            self.finish(HandshakeOutcome::Aborted);
        } else if self.tls_required() {
            self.reply_error(option, REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS first");
        } else if option_is_known(option) {
            self.reply_error(option, REP_ERR_TOO_BIG, "option data too long");
        } else {
            self.reply_error(option, REP_ERR_UNSUP, "option not supported");
        }
    }

    fn handle_option(&mut self, option: u32, data: &[u8], exports: &(impl Exports + ?Sized)) {
        if option == OPT_STARTTLS {
            return self.handle_starttls(data);
        }
        if self.tls_required() {
            return self.reply_error(option, REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS first");
        }
        match option {
            OPT_EXPORT_NAME => self.handle_export_name(data, exports),
            OPT_LIST => self.handle_list(data, exports),
            OPT_INFO | OPT_GO => self.handle_info_or_go(option, data, exports),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply_error(option, REP_ERR_INVALID, "option takes no data");
                } else {
                    self.structured_replies = true;
                    self.reply(option, REP_ACK, &[]);
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.handle_meta_context(option, data, exports),
            _ => unreachable!("option {option} is not one we read into memory"),
        }
    }

    fn handle_starttls(&mut self, data: &[u8]) {
        if !self.config.tls {
            self.reply_error(OPT_STARTTLS, REP_ERR_POLICY, "TLS is not configured on this server");
        } else if self.tls_active {
            self.reply_error(OPT_STARTTLS, REP_ERR_INVALID, "TLS is already established");
        } else if !data.is_empty() {
            self.reply_error(OPT_STARTTLS, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data");
        } else {
            self.reply(OPT_STARTTLS, REP_ACK, &[]);
            // Nothing negotiated in the clear survives into TLS.
            self.structured_replies = false;
            self.meta_context_export = None;
            self.state = State::AwaitingTls;
        }
    }

    fn handle_export_name(&mut self, data: &[u8], exports: &(impl Exports + ?Sized)) {
        let export = match std::str::from_utf8(data) {
            Ok(name) => exports.find(name),
            Err(_) => None,
        };
        let Some(export) = export else {
            // No error reply exists for NBD_OPT_EXPORT_NAME: the spec says to end the session.
            self.finish(HandshakeOutcome::Fatal(FatalError::UnknownExport(String::from_utf8_lossy(data).into_owned())));
            return;
        };
        if let Err(reason) = exports.open(&export) {
            self.finish(HandshakeOutcome::Fatal(FatalError::ExportRefused { name: export.name, reason }));
            return;
        }
        let flags = self.transmission_flags(&export);
        put_u64(&mut self.output, export.size_bytes);
        put_u16(&mut self.output, flags);
        if !self.client_no_zeroes {
            self.output.extend_from_slice(&[0u8; 124]);
        }
        self.enter_transmission(export, flags);
    }

    fn handle_list(&mut self, data: &[u8], exports: &(impl Exports + ?Sized)) {
        if !data.is_empty() {
            self.reply_error(OPT_LIST, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
            return;
        }
        for export in exports.list() {
            let mut payload = Vec::with_capacity(4 + export.name.len() + export.description.len());
            put_u32(&mut payload, export.name.len() as u32);
            payload.extend_from_slice(export.name.as_bytes());
            payload.extend_from_slice(export.description.as_bytes());
            self.reply(OPT_LIST, REP_SERVER, &payload);
        }
        self.reply(OPT_LIST, REP_ACK, &[]);
    }

    fn handle_info_or_go(&mut self, option: u32, data: &[u8], exports: &(impl Exports + ?Sized)) {
        let Some((name, requests)) = parse_info_request(data) else {
            self.reply_error(option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/NBD_OPT_GO data");
            return;
        };
        let Some(export) = exports.find(name) else {
            self.reply_error(option, REP_ERR_UNKNOWN, bounded(&exports.unknown(name)));
            return;
        };
        if option == OPT_GO {
            if let Err(reason) = exports.open(&export) {
                self.reply_error(option, REP_ERR_UNKNOWN, bounded(&reason));
                return;
            }
        }
        let flags = self.transmission_flags(&export);
        let mut info = Vec::with_capacity(12);
        put_u16(&mut info, INFO_EXPORT);
        put_u64(&mut info, export.size_bytes);
        put_u16(&mut info, flags);
        self.reply(option, REP_INFO, &info);

        // Block size constraints are sent unasked: we enforce non-default ones, and the spec
        // lets a server send information the client did not request.
        let mut info = Vec::with_capacity(14);
        put_u16(&mut info, INFO_BLOCK_SIZE);
        put_u32(&mut info, BLOCK_SIZE_MIN_BYTES);
        put_u32(&mut info, BLOCK_SIZE_PREFERRED_BYTES);
        put_u32(&mut info, BLOCK_SIZE_MAX_BYTES);
        self.reply(option, REP_INFO, &info);

        if requests.name {
            let mut info = Vec::with_capacity(2 + export.name.len());
            put_u16(&mut info, INFO_NAME);
            info.extend_from_slice(export.name.as_bytes());
            self.reply(option, REP_INFO, &info);
        }
        if requests.description && !export.description.is_empty() {
            let mut info = Vec::with_capacity(2 + export.description.len());
            put_u16(&mut info, INFO_DESCRIPTION);
            info.extend_from_slice(export.description.as_bytes());
            self.reply(option, REP_INFO, &info);
        }
        self.reply(option, REP_ACK, &[]);
        if option == OPT_GO {
            self.enter_transmission(export, flags);
        }
    }

    fn handle_meta_context(&mut self, option: u32, data: &[u8], exports: &(impl Exports + ?Sized)) {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // Replaces the previous selection even when this request fails.
            self.meta_context_export = None;
            if !self.structured_replies {
                self.reply_error(option, REP_ERR_INVALID, "negotiate structured replies first");
                return;
            }
        }
        let Some(request) = parse_meta_context_request(data) else {
            self.reply_error(option, REP_ERR_INVALID, "malformed metadata context request");
            return;
        };
        if exports.find(request.export_name).is_none() {
            self.reply_error(option, REP_ERR_UNKNOWN, bounded(&exports.unknown(request.export_name)));
            return;
        }
        let selected = if request.query_count == 0 {
            // No query lists every context, and selects none.
            !set
        } else {
            request.base_allocation || (!set && request.base_wildcard)
        };
        if selected {
            let mut payload = Vec::with_capacity(4 + BASE_ALLOCATION.len());
            put_u32(&mut payload, if set { BASE_ALLOCATION_CONTEXT_ID } else { 0 });
            payload.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.reply(option, REP_META_CONTEXT, &payload);
            if set {
                self.meta_context_export = Some(request.export_name.to_owned());
            }
        }
        self.reply(option, REP_ACK, &[]);
    }

    fn transmission_flags(&self, export: &ExportInfo) -> u16 {
        let mut flags = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;
        if export.read_only {
            flags |= FLAG_READ_ONLY;
        } else {
            flags |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
        }
        if self.structured_replies {
            // Every read reply is a single content chunk, so "don't fragment" always holds.
            flags |= FLAG_SEND_DF;
        }
        if self.config.multi_conn {
            flags |= FLAG_CAN_MULTI_CONN;
        }
        flags
    }

    fn enter_transmission(&mut self, export: ExportInfo, flags: u16) {
        let block_status = self.meta_context_export.as_deref() == Some(export.name.as_str());
        let transmission = Transmission::new(export, flags, self.structured_replies, block_status);
        self.finish(HandshakeOutcome::Transmission(transmission));
    }

    fn reply(&mut self, option: u32, reply_type: u32, payload: &[u8]) {
        put_u64(&mut self.output, OPTION_REPLY_MAGIC);
        put_u32(&mut self.output, option);
        put_u32(&mut self.output, reply_type);
        let length = u32::try_from(payload.len()).expect("option replies are built from bounded parts");
        put_u32(&mut self.output, length);
        self.output.extend_from_slice(payload);
    }

    fn reply_error(&mut self, option: u32, reply_type: u32, message: &str) {
        assert!(reply_type & (1 << 31) != 0);
        self.reply(option, reply_type, message.as_bytes());
    }
}

/// `text` cut to at most `STRING_BYTES_MAX` bytes, at a character boundary: a refusal's reason
/// comes from the caller, and a reply's message is a string the spec bounds.
fn bounded(text: &str) -> &str {
    let mut end = text.len().min(STRING_BYTES_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn option_is_known(option: u32) -> bool {
    matches!(
        option,
        OPT_EXPORT_NAME
            | OPT_ABORT
            | OPT_STARTTLS
            | OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
    )
}

#[derive(Default)]
struct InfoRequests {
    name: bool,
    description: bool,
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: name length, name, request count, requests. The lengths
/// must account for every byte.
fn parse_info_request(data: &[u8]) -> Option<(&str, InfoRequests)> {
    let mut reader = Reader::new(data);
    let name_length = reader.u32()? as usize;
    if name_length > STRING_BYTES_MAX {
        return None;
    }
    let name = std::str::from_utf8(reader.take(name_length)?).ok()?;
    let count = reader.u16()? as usize;
    if reader.remaining() != 2 * count {
        return None;
    }
    let mut requests = InfoRequests::default();
    for _ in 0..count {
        match reader.u16()? {
            INFO_NAME => requests.name = true,
            INFO_DESCRIPTION => requests.description = true,
            // NBD_INFO_EXPORT and NBD_INFO_BLOCK_SIZE are always sent; unknown ones are ignored.
            _ => {}
        }
    }
    Some((name, requests))
}

struct MetaContextRequest<'a> {
    export_name: &'a str,
    query_count: u32,
    /// Some query was exactly `base:allocation`.
    base_allocation: bool,
    /// Some query was `base:` (a wildcard when listing).
    base_wildcard: bool,
}

/// `NBD_OPT_{LIST,SET}_META_CONTEXT` data: export name, query count, queries. Queries in other
/// namespaces and unknown `base:` leaves are ignored, as the spec requires; a query without a
/// namespace is invalid.
fn parse_meta_context_request(data: &[u8]) -> Option<MetaContextRequest<'_>> {
    let mut reader = Reader::new(data);
    let name_length = reader.u32()? as usize;
    if name_length > STRING_BYTES_MAX {
        return None;
    }
    let export_name = std::str::from_utf8(reader.take(name_length)?).ok()?;
    let query_count = reader.u32()?;
    let mut request = MetaContextRequest { export_name, query_count, base_allocation: false, base_wildcard: false };
    // The count comes from the client: loop on it, but every query consumes at least 4 bytes of
    // bounded data, so a huge count fails quickly.
    for _ in 0..query_count {
        let query_length = reader.u32()? as usize;
        if query_length > STRING_BYTES_MAX {
            return None;
        }
        let query = std::str::from_utf8(reader.take(query_length)?).ok()?;
        let (namespace, leaf) = query.split_once(':')?;
        if namespace == "base" {
            match leaf {
                "allocation" => request.base_allocation = true,
                "" => request.base_wildcard = true,
                _ => {}
            }
        }
    }
    if reader.remaining() != 0 {
        return None;
    }
    Some(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exports() -> Vec<ExportInfo> {
        vec![
            ExportInfo { name: "vol1".into(), size_bytes: 1 << 20, description: "first".into(), read_only: false },
            ExportInfo { name: "".into(), size_bytes: 4096, description: String::new(), read_only: false },
            ExportInfo { name: "vol1@s".into(), size_bytes: 8192, description: String::new(), read_only: true },
        ]
    }

    fn option(option: u32, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_u64(&mut out, IHAVEOPT);
        put_u32(&mut out, option);
        put_u32(&mut out, data.len() as u32);
        out.extend_from_slice(data);
        out
    }

    fn go_data(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut out = Vec::new();
        put_u32(&mut out, name.len() as u32);
        out.extend_from_slice(name.as_bytes());
        put_u16(&mut out, requests.len() as u16);
        for request in requests {
            put_u16(&mut out, *request);
        }
        out
    }

    fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        put_u32(&mut out, name.len() as u32);
        out.extend_from_slice(name.as_bytes());
        put_u32(&mut out, queries.len() as u32);
        for query in queries {
            put_u32(&mut out, query.len() as u32);
            out.extend_from_slice(query.as_bytes());
        }
        out
    }

    /// Parses the server's option replies into `(option, type, payload)` triples.
    fn replies(mut bytes: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let mut reader = Reader::new(bytes);
            assert_eq!(reader.u64(), Some(OPTION_REPLY_MAGIC));
            let option = reader.u32().unwrap();
            let reply_type = reader.u32().unwrap();
            let length = reader.u32().unwrap() as usize;
            out.push((option, reply_type, reader.take(length).unwrap().to_vec()));
            bytes = &bytes[OPTION_REPLY_HEADER_BYTES + length..];
        }
        out
    }

    /// A handshake past the greeting and client flags.
    fn started(client_flags: u32) -> Handshake {
        let mut handshake = Handshake::new(HandshakeConfig { multi_conn: true, tls: false });
        let greeting = handshake.poll_transmit().unwrap();
        assert_eq!(greeting.len(), 18);
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        assert_eq!(&greeting[8..16], b"IHAVEOPT");
        assert_eq!(&greeting[16..], &[0, 3]);
        assert_eq!(handshake.handle_input(&client_flags.to_be_bytes(), &exports()), 4);
        handshake
    }

    /// Feeds `input` (in one piece, then byte by byte on a fresh handshake, which must behave
    /// the same) and checks the option replies, as `(option, reply type, payload)`.
    fn check(input: &[u8], expected: &[(u32, u32, &[u8])]) -> Handshake {
        let mut whole = started(1);
        assert_eq!(whole.handle_input(input, &exports()), input.len());
        let whole_output = whole.poll_transmit().unwrap_or_default();

        let mut trickle = started(1);
        let mut pending = Vec::new();
        for byte in input {
            pending.push(*byte);
            let consumed = trickle.handle_input(&pending, &exports());
            pending.drain(..consumed);
        }
        assert!(pending.is_empty());
        assert_eq!(trickle.poll_transmit().unwrap_or_default(), whole_output);

        let got = replies(&whole_output);
        let expected: Vec<(u32, u32, Vec<u8>)> = expected.iter().map(|(o, t, p)| (*o, *t, p.to_vec())).collect();
        assert_eq!(got, expected);
        whole
    }

    fn info_export(size: u64, flags: u16) -> Vec<u8> {
        let mut out = Vec::new();
        put_u16(&mut out, INFO_EXPORT);
        put_u64(&mut out, size);
        put_u16(&mut out, flags);
        out
    }

    fn info_block_size() -> Vec<u8> {
        let mut out = Vec::new();
        put_u16(&mut out, INFO_BLOCK_SIZE);
        put_u32(&mut out, 512);
        put_u32(&mut out, 4096);
        put_u32(&mut out, 32 << 20);
        out
    }

    const FLAGS_SIMPLE: u16 = 0b1001_0110_1101; // HAS_FLAGS FLUSH FUA TRIM WZ MULTI_CONN FAST_ZERO
    const FLAGS_STRUCTURED: u16 = FLAGS_SIMPLE | FLAG_SEND_DF;

    #[test]
    fn flags_constant_is_what_we_mean() {
        assert_eq!(
            FLAGS_SIMPLE,
            FLAG_HAS_FLAGS
                | FLAG_SEND_FLUSH
                | FLAG_SEND_FUA
                | FLAG_SEND_TRIM
                | FLAG_SEND_WRITE_ZEROES
                | FLAG_CAN_MULTI_CONN
                | FLAG_SEND_FAST_ZERO
        );
        assert_eq!(FLAGS_SIMPLE & FLAG_READ_ONLY, 0);
    }

    #[test]
    fn go_with_all_information() {
        let input = option(OPT_GO, &go_data("vol1", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]));
        let mut name = vec![0, 1];
        name.extend_from_slice(b"vol1");
        let mut description = vec![0, 2];
        description.extend_from_slice(b"first");
        let mut handshake = check(
            &input,
            &[
                (OPT_GO, REP_INFO, &info_export(1 << 20, FLAGS_SIMPLE)),
                (OPT_GO, REP_INFO, &info_block_size()),
                (OPT_GO, REP_INFO, &name),
                (OPT_GO, REP_INFO, &description),
                (OPT_GO, REP_ACK, &[]),
            ],
        );
        match handshake.poll_outcome() {
            Some(HandshakeOutcome::Transmission(transmission)) => {
                assert_eq!(transmission.export().name, "vol1");
                assert!(!transmission.structured_replies());
                assert!(!transmission.block_status_enabled());
            }
            other => panic!("unexpected outcome {other:?}"),
        }
    }

    #[test]
    fn a_read_only_export_is_advertised_so_without_trim_or_zeroes() {
        let read_only = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_CAN_MULTI_CONN | FLAG_READ_ONLY;
        check(
            &option(OPT_INFO, &go_data("vol1@s", &[])),
            &[
                (OPT_INFO, REP_INFO, &info_export(8192, read_only)),
                (OPT_INFO, REP_INFO, &info_block_size()),
                (OPT_INFO, REP_ACK, &[]),
            ],
        );
    }

    #[test]
    fn info_does_not_end_the_handshake() {
        let input = option(OPT_INFO, &go_data("", &[]));
        let mut handshake = check(
            &input,
            &[
                (OPT_INFO, REP_INFO, &info_export(4096, FLAGS_SIMPLE)),
                (OPT_INFO, REP_INFO, &info_block_size()),
                (OPT_INFO, REP_ACK, &[]),
            ],
        );
        assert!(handshake.poll_outcome().is_none());
        assert!(!handshake.is_done());
    }

    #[test]
    #[rustfmt::skip]
    fn option_errors() {
        // Table: option, data, expected reply type.
        let mut long_name = go_data("vol1", &[]);
        long_name[3] = 200; // name length past the data
        let mut odd_requests = go_data("vol1", &[INFO_NAME]);
        odd_requests.push(0); // a trailing byte
        let cases: Vec<(u32, Vec<u8>, u32)> = vec![
            (OPT_GO, go_data("nope", &[]), REP_ERR_UNKNOWN),
            (OPT_INFO, go_data("nope", &[]), REP_ERR_UNKNOWN),
            (OPT_GO, long_name, REP_ERR_INVALID),
            (OPT_GO, odd_requests, REP_ERR_INVALID),
            (OPT_GO, vec![0, 0], REP_ERR_INVALID),
            (OPT_GO, go_data("\u{0}\u{ff}", &[]), REP_ERR_UNKNOWN),
            (OPT_LIST, vec![1], REP_ERR_INVALID),
            (OPT_STRUCTURED_REPLY, vec![1], REP_ERR_INVALID),
            // The server supports TLS but this one is not configured for it.
            (OPT_STARTTLS, vec![], REP_ERR_POLICY),
            (4, vec![1, 2, 3], REP_ERR_UNSUP),
            (0xdead_beef, vec![0; 100], REP_ERR_UNSUP),
            // Setting a context before structured replies were negotiated.
            (OPT_SET_META_CONTEXT, meta_data("vol1", &["base:allocation"]), REP_ERR_INVALID),
            (OPT_LIST_META_CONTEXT, meta_data("nope", &[]), REP_ERR_UNKNOWN),
            (OPT_LIST_META_CONTEXT, meta_data("vol1", &["nocolon"]), REP_ERR_INVALID),
            (OPT_LIST_META_CONTEXT, vec![0, 0, 0, 0, 0, 0, 0, 1], REP_ERR_INVALID),
        ];
        for (opt, data, reply_type) in cases {
            let input = option(opt, &data);
            let mut handshake = started(1);
            assert_eq!(handshake.handle_input(&input, &exports()), input.len());
            let got = replies(&handshake.poll_transmit().unwrap());
            assert_eq!(got.len(), 1, "option {opt} data {data:?}");
            assert_eq!(
                (got[0].0, got[0].1),
                (opt, reply_type),
                "option {opt} data {data:?}"
            );
            assert!(handshake.poll_outcome().is_none());
        }
    }

    #[test]
    fn huge_option_is_skipped_without_buffering() {
        let mut handshake = started(1);
        let mut header = Vec::new();
        put_u64(&mut header, IHAVEOPT);
        put_u32(&mut header, OPT_GO);
        put_u32(&mut header, 3_000_000_000);
        assert_eq!(handshake.handle_input(&header, &exports()), 16);
        let chunk = vec![0u8; 1 << 20];
        let mut remaining: u64 = 3_000_000_000;
        while remaining > 0 {
            let piece = &chunk[..remaining.min(chunk.len() as u64) as usize];
            assert_eq!(handshake.handle_input(piece, &exports()), piece.len());
            remaining -= piece.len() as u64;
            if remaining > 0 {
                assert!(handshake.poll_transmit().is_none());
            }
        }
        let got = replies(&handshake.poll_transmit().unwrap());
        assert_eq!(got, vec![(OPT_GO, REP_ERR_TOO_BIG, b"option data too long".to_vec())]);
        // And the next option is understood.
        let input = option(OPT_LIST, &[]);
        assert_eq!(handshake.handle_input(&input, &exports()), input.len());
        assert_eq!(replies(&handshake.poll_transmit().unwrap()).len(), 4);
    }

    #[test]
    fn list() {
        let mut first = Vec::new();
        put_u32(&mut first, 4);
        first.extend_from_slice(b"vol1first");
        let mut third = Vec::new();
        put_u32(&mut third, 6);
        third.extend_from_slice(b"vol1@s");
        check(
            &option(OPT_LIST, &[]),
            &[
                (OPT_LIST, REP_SERVER, &first),
                (OPT_LIST, REP_SERVER, &[0, 0, 0, 0]),
                (OPT_LIST, REP_SERVER, &third),
                (OPT_LIST, REP_ACK, &[]),
            ],
        );
    }

    #[test]
    fn abort_is_acknowledged_even_with_data() {
        let mut handshake = check(&option(OPT_ABORT, b"junk"), &[(OPT_ABORT, REP_ACK, &[])]);
        assert!(matches!(handshake.poll_outcome(), Some(HandshakeOutcome::Aborted)));
        assert_eq!(handshake.handle_input(b"more", &exports()), 0);
    }

    #[test]
    fn meta_context_selection() {
        let mut context = Vec::new();
        put_u32(&mut context, BASE_ALLOCATION_CONTEXT_ID);
        context.extend_from_slice(b"base:allocation");
        let mut listed = Vec::new();
        put_u32(&mut listed, 0);
        listed.extend_from_slice(b"base:allocation");

        let mut input = option(OPT_STRUCTURED_REPLY, &[]);
        input.extend(option(OPT_LIST_META_CONTEXT, &meta_data("vol1", &[])));
        input.extend(option(OPT_LIST_META_CONTEXT, &meta_data("vol1", &["base:"])));
        input.extend(option(OPT_LIST_META_CONTEXT, &meta_data("vol1", &["qemu:dirty-bitmap:x"])));
        input.extend(option(OPT_SET_META_CONTEXT, &meta_data("vol1", &["base:"])));
        input.extend(option(OPT_SET_META_CONTEXT, &meta_data("vol1", &["x-foo:bar", "base:allocation", "base:other"])));
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        let mut handshake = check(
            &input,
            &[
                (OPT_STRUCTURED_REPLY, REP_ACK, &[]),
                (OPT_LIST_META_CONTEXT, REP_META_CONTEXT, &listed),
                (OPT_LIST_META_CONTEXT, REP_ACK, &[]),
                (OPT_LIST_META_CONTEXT, REP_META_CONTEXT, &listed),
                (OPT_LIST_META_CONTEXT, REP_ACK, &[]),
                (OPT_LIST_META_CONTEXT, REP_ACK, &[]),
                (OPT_SET_META_CONTEXT, REP_ACK, &[]),
                (OPT_SET_META_CONTEXT, REP_META_CONTEXT, &context),
                (OPT_SET_META_CONTEXT, REP_ACK, &[]),
                (OPT_GO, REP_INFO, &info_export(1 << 20, FLAGS_STRUCTURED)),
                (OPT_GO, REP_INFO, &info_block_size()),
                (OPT_GO, REP_ACK, &[]),
            ],
        );
        match handshake.poll_outcome() {
            Some(HandshakeOutcome::Transmission(transmission)) => {
                assert!(transmission.structured_replies());
                assert!(transmission.block_status_enabled());
                assert_eq!(transmission.flags(), FLAGS_STRUCTURED);
            }
            other => panic!("unexpected outcome {other:?}"),
        }
    }

    #[test]
    fn meta_context_for_another_export_does_not_carry_over() {
        let mut input = option(OPT_STRUCTURED_REPLY, &[]);
        input.extend(option(OPT_SET_META_CONTEXT, &meta_data("", &["base:allocation"])));
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        let mut handshake = started(1);
        assert_eq!(handshake.handle_input(&input, &exports()), input.len());
        match handshake.poll_outcome() {
            Some(HandshakeOutcome::Transmission(transmission)) => {
                assert!(!transmission.block_status_enabled())
            }
            other => panic!("unexpected outcome {other:?}"),
        }
    }

    #[test]
    fn export_name_with_and_without_zeroes() {
        for (client_flags, zeroes) in [(1u32, 124usize), (3, 0)] {
            let mut handshake = started(client_flags);
            let mut input = option(OPT_EXPORT_NAME, b"vol1");
            input.extend_from_slice(b"rest");
            // The bytes after the option belong to the transmission phase.
            assert_eq!(handshake.handle_input(&input, &exports()), input.len() - 4);
            let output = handshake.poll_transmit().unwrap();
            assert_eq!(output.len(), 10 + zeroes);
            assert_eq!(&output[..8], &(1u64 << 20).to_be_bytes());
            assert_eq!(&output[8..10], &FLAGS_SIMPLE.to_be_bytes());
            assert!(output[10..].iter().all(|b| *b == 0));
            assert!(matches!(handshake.poll_outcome(), Some(HandshakeOutcome::Transmission(_))));
        }
    }

    /// Exports whose `open` refuses `vol1` (a volume being deleted, say) and counts the others.
    struct Refusing {
        opened: std::cell::RefCell<Vec<String>>,
        reason: String,
    }

    impl Exports for Refusing {
        fn list(&self) -> Vec<ExportInfo> {
            exports()
        }

        fn unknown(&self, name: &str) -> String {
            match name {
                "gone" => self.reason.clone(),
                _ => NO_SUCH_EXPORT.into(),
            }
        }

        fn open(&self, export: &ExportInfo) -> Result<(), String> {
            if export.name == "vol1" {
                return Err(self.reason.clone());
            }
            self.opened.borrow_mut().push(export.name.clone());
            Ok(())
        }
    }

    #[test]
    fn a_refused_go_gets_an_error_with_the_reason_and_the_client_may_go_elsewhere() {
        let refusing = Refusing { opened: Default::default(), reason: "volume vol1 is being deleted".into() };
        let mut handshake = started(1);
        // NBD_OPT_INFO only looks: it is answered in full and opens nothing.
        let mut input = option(OPT_INFO, &go_data("vol1", &[]));
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        input.extend(option(OPT_GO, &go_data("", &[])));
        assert_eq!(handshake.handle_input(&input, &refusing), input.len());
        let got = replies(&handshake.poll_transmit().unwrap());
        let types: Vec<(u32, u32)> = got.iter().map(|(option, kind, _)| (*option, *kind)).collect();
        assert_eq!(
            types,
            [
                (OPT_INFO, REP_INFO),
                (OPT_INFO, REP_INFO),
                (OPT_INFO, REP_ACK),
                (OPT_GO, REP_ERR_UNKNOWN),
                (OPT_GO, REP_INFO),
                (OPT_GO, REP_INFO),
                (OPT_GO, REP_ACK),
            ]
        );
        assert_eq!(got[3].2, b"volume vol1 is being deleted");
        assert_eq!(*refusing.opened.borrow(), [String::new()]);
        match handshake.poll_outcome() {
            Some(HandshakeOutcome::Transmission(transmission)) => assert_eq!(transmission.export().name, ""),
            other => panic!("unexpected outcome {other:?}"),
        }
    }

    #[test]
    fn an_export_not_found_is_refused_with_the_reason_the_exports_give() {
        let refusing = Refusing { opened: Default::default(), reason: "snapshot gone is being deleted".into() };
        let mut handshake = started(1);
        let mut input = option(OPT_STRUCTURED_REPLY, &[]);
        input.extend(option(OPT_INFO, &go_data("gone", &[])));
        input.extend(option(OPT_SET_META_CONTEXT, &meta_data("gone", &["base:allocation"])));
        input.extend(option(OPT_GO, &go_data("gone", &[])));
        input.extend(option(OPT_GO, &go_data("other", &[])));
        assert_eq!(handshake.handle_input(&input, &refusing), input.len());
        let got = replies(&handshake.poll_transmit().unwrap());
        let errors: Vec<(u32, u32, &[u8])> =
            got.iter().skip(1).map(|(option, kind, data)| (*option, *kind, data.as_slice())).collect();
        assert_eq!(
            errors,
            [
                (OPT_INFO, REP_ERR_UNKNOWN, b"snapshot gone is being deleted".as_slice()),
                (OPT_SET_META_CONTEXT, REP_ERR_UNKNOWN, b"snapshot gone is being deleted".as_slice()),
                (OPT_GO, REP_ERR_UNKNOWN, b"snapshot gone is being deleted".as_slice()),
                (OPT_GO, REP_ERR_UNKNOWN, b"no such export".as_slice()),
            ]
        );
        assert!(refusing.opened.borrow().is_empty());
        assert!(handshake.poll_outcome().is_none());
    }

    #[test]
    fn a_refusal_longer_than_a_string_may_be_is_cut_at_a_character_boundary() {
        let refusing = Refusing { opened: Default::default(), reason: format!("x{}", "é".repeat(STRING_BYTES_MAX)) };
        let mut handshake = started(1);
        let input = option(OPT_GO, &go_data("vol1", &[]));
        assert_eq!(handshake.handle_input(&input, &refusing), input.len());
        let got = replies(&handshake.poll_transmit().unwrap());
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1, REP_ERR_UNKNOWN);
        // One byte, then two-byte characters: byte STRING_BYTES_MAX falls inside one.
        assert_eq!(got[0].2.len(), STRING_BYTES_MAX - 1);
        assert!(std::str::from_utf8(&got[0].2).is_ok());
        assert!(handshake.poll_outcome().is_none());
    }

    #[test]
    fn a_refused_export_name_ends_the_session_with_the_reason() {
        let refusing = Refusing { opened: Default::default(), reason: "being shrunk".into() };
        let mut handshake = started(1);
        handshake.handle_input(&option(OPT_EXPORT_NAME, b"vol1"), &refusing);
        assert!(handshake.poll_transmit().is_none());
        match handshake.poll_outcome() {
            Some(HandshakeOutcome::Fatal(error)) => {
                assert_eq!(error, FatalError::ExportRefused { name: "vol1".into(), reason: "being shrunk".into() })
            }
            other => panic!("unexpected outcome {other:?}"),
        }
        assert!(refusing.opened.borrow().is_empty());
    }

    #[test]
    #[rustfmt::skip]
    fn fatal_inputs() {
        // Table: client flags, then the option bytes, and the fatal error expected.
        let cases: Vec<(u32, Vec<u8>, FatalError)> = vec![
            (4, vec![], FatalError::ClientFlags(4)),
            (1, option(OPT_EXPORT_NAME, b"nope"), FatalError::UnknownExport("nope".into())),
            (1, option(OPT_EXPORT_NAME, &[0xff; 5000]), FatalError::ExportName),
            (1, b"NOTMAGIC\0\0\0\x01\0\0\0\0".to_vec(), FatalError::OptionMagic(0x4e4f_544d_4147_4943)),
        ];
        for (client_flags, input, expected) in cases {
            let mut handshake = Handshake::new(HandshakeConfig { multi_conn: false, tls: false });
            handshake.poll_transmit();
            let mut bytes = client_flags.to_be_bytes().to_vec();
            bytes.extend_from_slice(&input);
            handshake.handle_input(&bytes, &exports());
            assert!(handshake.poll_transmit().is_none());
            match handshake.poll_outcome() {
                Some(HandshakeOutcome::Fatal(error)) => assert_eq!(error, expected),
                other => panic!("unexpected outcome {other:?}"),
            }
        }
    }

    fn started_tls() -> Handshake {
        let mut handshake = Handshake::new(HandshakeConfig { multi_conn: false, tls: true });
        handshake.poll_transmit().unwrap();
        assert_eq!(handshake.handle_input(&1u32.to_be_bytes(), &exports()), 4);
        handshake
    }

    #[test]
    fn forced_tls_refuses_every_option_but_starttls_and_abort() {
        let mut handshake = started_tls();
        let mut input = option(OPT_LIST, &[]);
        input.extend(option(OPT_STRUCTURED_REPLY, &[]));
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        input.extend(option(OPT_INFO, &vec![0; OPTION_DATA_BYTES_MAX as usize + 1]));
        input.extend(option(99, &[]));
        assert_eq!(handshake.handle_input(&input, &exports()), input.len());
        let got = replies(&handshake.poll_transmit().unwrap());
        let kinds: Vec<(u32, u32)> = got.iter().map(|(o, t, _)| (*o, *t)).collect();
        assert_eq!(
            kinds,
            [
                (OPT_LIST, REP_ERR_TLS_REQD),
                (OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD),
                (OPT_GO, REP_ERR_TLS_REQD),
                (OPT_INFO, REP_ERR_TLS_REQD),
                (99, REP_ERR_TLS_REQD)
            ]
        );
        assert!(handshake.poll_outcome().is_none() && !handshake.wants_tls());
        // NBD_OPT_EXPORT_NAME cannot be refused with a reply: the connection ends.
        let input = option(OPT_EXPORT_NAME, b"vol1");
        handshake.handle_input(&input, &exports());
        assert!(matches!(handshake.poll_outcome(), Some(HandshakeOutcome::Fatal(FatalError::TlsRequired))));
    }

    #[test]
    fn starttls_stops_consuming_until_tls_is_up_then_starts_afresh() {
        let mut handshake = started_tls();
        let mut input = option(OPT_STARTTLS, &[]);
        // A client (or an attacker in the path) that sends more before TLS: none of it is read.
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        let consumed = handshake.handle_input(&input, &exports());
        assert_eq!(consumed, OPTION_HEADER_BYTES);
        assert_eq!(replies(&handshake.poll_transmit().unwrap()), vec![(OPT_STARTTLS, REP_ACK, vec![])]);
        assert!(handshake.wants_tls());
        assert_eq!(handshake.handle_input(&input[consumed..], &exports()), 0);
        handshake.tls_established();
        assert!(!handshake.wants_tls());
        // Inside TLS: a second STARTTLS is invalid, everything else works.
        let mut input = option(OPT_STARTTLS, &[]);
        input.extend(option(OPT_STRUCTURED_REPLY, &[]));
        input.extend(option(OPT_GO, &go_data("vol1", &[])));
        assert_eq!(handshake.handle_input(&input, &exports()), input.len());
        let got = replies(&handshake.poll_transmit().unwrap());
        assert_eq!(got[0].1, REP_ERR_INVALID);
        assert_eq!((got[1].0, got[1].1), (OPT_STRUCTURED_REPLY, REP_ACK));
        let Some(HandshakeOutcome::Transmission(transmission)) = handshake.poll_outcome() else {
            panic!("NBD_OPT_GO inside TLS enters transmission")
        };
        assert!(transmission.structured_replies());
    }
}
