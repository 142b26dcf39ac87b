//! Mutual TLS between every StarFish process, and the certificates that carry each one's role.
//!
//! A cluster has one private CA. Every certificate it signs names its holder (the subject's
//! common name) and its *role* (the subject's organizational unit): `host` (a host element),
//! `element`, `admin` (an operator: admin mutations and NBD) or `client` (an NBD host only).
//! A peer is trusted for what its role allows, never for the address it comes from or connects
//! to, so an element's certificate need not name the addresses it is reached at: a server's
//! chain is checked against the CA but not its name (the role is checked instead).
//!
//! A TLS directory (`--tls-dir`) holds `ca-cert.pem` and this process's certificate and key:
//! `cert.pem` and `key.pem`, or the names qemu and libnbd use (`client-cert.pem` and
//! `client-key.pem`, `server-cert.pem` and `server-key.pem`). `starfish certs init` makes them.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::local_socket::LocalStream;

use crate::far_link::FecStream;

/// Time a peer has to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a certificate's holder may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A host element: writes, epochs, recovery orders, reads.
    Host,
    /// A storage element: fetches from a peer's replay log and copies blocks.
    Element,
    /// An operator: changes the cluster through the admin address; may use NBD too.
    Admin,
    /// An NBD host: reads and writes volumes over NBD, nothing else.
    Client,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Host, Role::Element, Role::Admin, Role::Client];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Host => "host",
            Role::Element => "element",
            Role::Admin => "admin",
            Role::Client => "client",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|role| role.as_str() == text)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a verified peer is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.role, self.name)
    }
}

/// The role and name a certificate carries, if it is one of ours.
pub fn identity_of(certificate: &CertificateDer<'_>) -> Result<Identity, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate.as_ref())
        .map_err(|e| format!("certificate does not parse: {e}"))?;
    let subject = parsed.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or("certificate names no holder (no common name)")?
        .to_owned();
    let roles: Vec<&str> = subject.iter_organizational_unit().filter_map(|ou| ou.as_str().ok()).collect();
    let role = match roles.as_slice() {
        [one] => Role::parse(one).ok_or_else(|| format!("certificate of {name:?} names an unknown role {one:?}"))?,
        [] => return Err(format!("certificate of {name:?} names no role (organizational unit)")),
        _ => return Err(format!("certificate of {name:?} names several roles")),
    };
    Ok(Identity { role, name })
}

/// Whether the server side asks the peer for a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerCertificate {
    /// The handshake fails without a certificate that chains to the CA.
    Required,
    /// A certificate is checked if given; without one the peer is anonymous.
    Optional,
}

/// One process's TLS identity and trust: load once, share.
#[derive(Clone)]
pub struct TlsContext {
    inner: Arc<Inner>,
}

struct Inner {
    identity: Identity,
    directory: PathBuf,
    server_required: tokio_rustls::TlsAcceptor,
    server_optional: tokio_rustls::TlsAcceptor,
    client: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsContext({}, {})", self.inner.identity, self.inner.directory.display())
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The first of `names` present in `directory`.
fn find_file(directory: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|name| directory.join(name)).find(|path| path.is_file())
}

impl TlsContext {
    /// Load a TLS directory: the CA, this process's certificate (chain) and key. Every problem
    /// is a sentence naming the file.
    pub fn load(directory: &Path) -> Result<TlsContext, String> {
        let in_dir = |what: &str| format!("TLS directory {}: {what}", directory.display());
        if !directory.is_dir() {
            return Err(in_dir("not a directory (make one with `starfish certs init`)"));
        }
        let ca_path = directory.join("ca-cert.pem");
        let cas = read_certificates(&ca_path)?;
        let mut roots = RootCertStore::empty();
        for ca in cas {
            roots.add(ca).map_err(|e| format!("{}: not a usable CA certificate: {e}", ca_path.display()))?;
        }
        let roots = Arc::new(roots);
        let cert_path = find_file(directory, &["cert.pem", "client-cert.pem", "server-cert.pem"])
            .ok_or_else(|| in_dir("no certificate (cert.pem, client-cert.pem or server-cert.pem)"))?;
        let key_path = find_file(directory, &["key.pem", "client-key.pem", "server-key.pem"])
            .ok_or_else(|| in_dir("no private key (key.pem, client-key.pem or server-key.pem)"))?;
        let chain = read_certificates(&cert_path)?;
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|e| format!("{}: cannot read a private key: {e}", key_path.display()))?;
        let identity = identity_of(&chain[0]).map_err(|e| format!("{}: {e}", cert_path.display()))?;

        let provider = provider();
        let server = |peer: PeerCertificate| -> Result<tokio_rustls::TlsAcceptor, String> {
            let builder = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
            let builder = match peer {
                PeerCertificate::Required => builder,
                PeerCertificate::Optional => builder.allow_unauthenticated(),
            };
            let verifier = builder.build().map_err(|e| in_dir(&format!("client verifier: {e}")))?;
            let config = ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|e| format!("{} and {}: {e}", cert_path.display(), key_path.display()))?;
            Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
        };
        let server_required = server(PeerCertificate::Required)?;
        let server_optional = server(PeerCertificate::Optional)?;
        let verifier = Arc::new(ClusterServerVerifier { roots: roots.clone(), provider: provider.clone() });
        let client = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("{} and {}: {e}", cert_path.display(), key_path.display()))?;
        Ok(TlsContext {
            inner: Arc::new(Inner {
                identity,
                directory: directory.to_owned(),
                server_required,
                server_optional,
                client: tokio_rustls::TlsConnector::from(Arc::new(client)),
            }),
        })
    }

    /// Who this process is, by its own certificate.
    pub fn identity(&self) -> &Identity {
        &self.inner.identity
    }

    /// The server side of a handshake on an accepted connection. With
    /// [`PeerCertificate::Optional`] the identity may be `None` (an anonymous peer).
    pub async fn accept<IO: Carrier>(
        &self,
        stream: IO,
        peer: PeerCertificate,
    ) -> Result<(Stream, Option<Identity>), String> {
        let acceptor = match peer {
            PeerCertificate::Required => &self.inner.server_required,
            PeerCertificate::Optional => &self.inner.server_optional,
        };
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
            .await
            .map_err(|_| format!("TLS handshake not finished within {HANDSHAKE_TIMEOUT:?}"))?
            .map_err(|e| describe_handshake_error(&e))?;
        let identity = match tls.get_ref().1.peer_certificates().and_then(|chain| chain.first()) {
            Some(certificate) => Some(identity_of(certificate)?),
            None => None,
        };
        Ok((IO::tls(tokio_rustls::TlsStream::Server(tls)), identity))
    }

    /// The client side of a handshake; the server's certificate must chain to the CA and name
    /// one of `expected` roles.
    pub async fn connect<IO: Carrier>(
        &self,
        stream: IO,
        address: SocketAddr,
        expected: &[Role],
    ) -> Result<Stream, String> {
        let name = ServerName::IpAddress(address.ip().into());
        let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.inner.client.connect(name, stream))
            .await
            .map_err(|_| format!("TLS handshake with {address} not finished within {HANDSHAKE_TIMEOUT:?}"))?
            .map_err(|e| format!("TLS handshake with {address}: {}", describe_handshake_error(&e)))?;
        let certificate = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .ok_or_else(|| format!("{address} presented no certificate"))?;
        let identity = identity_of(certificate).map_err(|e| format!("{address}: {e}"))?;
        if !expected.contains(&identity.role) {
            return Err(format!(
                "{address} presented the certificate of {identity}, not of a {}",
                expected.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(" or ")
            ));
        }
        Ok(IO::tls(tokio_rustls::TlsStream::Client(tls)))
    }
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not PEM certificates: {e}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!("{}: holds no certificate", path.display()));
    }
    Ok(certificates)
}

/// A handshake failure in words an operator acts on; an expired certificate says so.
pub fn describe_handshake_error(error: &io::Error) -> String {
    use rustls::{AlertDescription, CertificateError, Error as TlsError};
    let Some(tls) = error.get_ref().and_then(|inner| inner.downcast_ref::<TlsError>()) else {
        return match error.kind() {
            io::ErrorKind::UnexpectedEof => "the peer closed the connection during the TLS handshake".into(),
            io::ErrorKind::InvalidData => format!("not a TLS peer ({error})"),
            _ => format!("TLS handshake failed: {error}"),
        };
    };
    match tls {
        TlsError::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            format!("peer certificate expired: {tls}")
        }
        TlsError::InvalidCertificate(CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. }) => {
            format!("peer certificate not valid yet: {tls}")
        }
        TlsError::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            format!("peer certificate not signed by this cluster's CA: {tls}")
        }
        TlsError::NoCertificatesPresented => "the peer presented no certificate; this port requires one".into(),
        TlsError::AlertReceived(AlertDescription::CertificateExpired) => {
            "the peer refused our certificate: it has expired".into()
        }
        TlsError::AlertReceived(AlertDescription::UnknownCA | AlertDescription::BadCertificate) => {
            "the peer refused our certificate: not signed by its CA".into()
        }
        TlsError::AlertReceived(AlertDescription::DecryptError) => {
            "the peer refused our certificate (a decrypt error: most likely signed by another CA of the same name)"
                .into()
        }
        TlsError::AlertReceived(AlertDescription::CertificateRequired) => {
            "the peer requires a certificate and we presented none".into()
        }
        TlsError::InvalidMessage(_) => format!("not a TLS peer ({tls})"),
        other => format!("TLS handshake failed: {other}"),
    }
}

/// Server certificates are checked against the cluster CA and for their role, not their name:
/// elements are reached at whatever address the configuration gives.
#[derive(Debug)]
struct ClusterServerVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ClusterServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let certificate = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &certificate,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// A connection, plain or TLS, over TCP or the far link (UDP with FEC).
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
    Fec(FecStream),
    FecTls(Box<tokio_rustls::TlsStream<FecStream>>),
    /// An element's local socket (`crate::local_socket`), reached from the same machine.
    Local(LocalStream),
    LocalTls(Box<tokio_rustls::TlsStream<LocalStream>>),
}

/// What a connection is carried over: TCP or a far-link session.
pub trait Carrier: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    fn plain(self) -> Stream;
    fn tls(stream: tokio_rustls::TlsStream<Self>) -> Stream;
}

impl Carrier for TcpStream {
    fn plain(self) -> Stream {
        Stream::Plain(self)
    }
    fn tls(stream: tokio_rustls::TlsStream<Self>) -> Stream {
        Stream::Tls(Box::new(stream))
    }
}

impl Carrier for LocalStream {
    fn plain(self) -> Stream {
        Stream::Local(self)
    }
    fn tls(stream: tokio_rustls::TlsStream<Self>) -> Stream {
        Stream::LocalTls(Box::new(stream))
    }
}

impl Carrier for FecStream {
    fn plain(self) -> Stream {
        Stream::Fec(self)
    }
    fn tls(stream: tokio_rustls::TlsStream<Self>) -> Stream {
        Stream::FecTls(Box::new(stream))
    }
}

impl Stream {
    /// The far-link session under this stream, if it is carried by one.
    pub fn far_progress(&self) -> Option<crate::far_link::FarProgress> {
        match self {
            Stream::Fec(s) => Some(s.progress()),
            Stream::FecTls(s) => Some(s.get_ref().0.progress()),
            _ => None,
        }
    }

    /// Whether this stream is an element's local socket (`crate::local_socket`).
    pub fn is_local(&self) -> bool {
        matches!(self, Stream::Local(_) | Stream::LocalTls(_))
    }

    /// A lender of this stream's large pieces (`crate::lending`): a plain local socket's, where
    /// this process can lend; `None` for every other stream (their writes copy).
    pub fn lender(&self) -> Option<crate::lending::Lender> {
        match self {
            Stream::Local(stream) => stream.lender(),
            _ => None,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
            Stream::Fec(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Local(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::FecTls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
            Stream::LocalTls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
            Stream::Fec(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Local(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::FecTls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
            Stream::LocalTls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
            Stream::Fec(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::Local(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::FecTls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
            Stream::LocalTls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(stream) => stream.is_write_vectored(),
            Stream::Tls(stream) => stream.is_write_vectored(),
            Stream::Fec(stream) => stream.is_write_vectored(),
            Stream::Local(stream) => stream.is_write_vectored(),
            Stream::FecTls(stream) => stream.is_write_vectored(),
            Stream::LocalTls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
            Stream::Fec(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Local(stream) => Pin::new(stream).poll_flush(cx),
            Stream::FecTls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
            Stream::LocalTls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
            Stream::Fec(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Local(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::FecTls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
            Stream::LocalTls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Connect to a cluster peer over TCP, then TLS if `tls` is given (the peer must hold one of
/// `expected` roles). `timeout` bounds the TCP connect.
pub async fn connect(
    address: SocketAddr,
    tls: Option<&TlsContext>,
    expected: &[Role],
    timeout: std::time::Duration,
) -> Result<Stream, String> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(address))
        .await
        .map_err(|_| format!("connecting to {address} timed out"))?
        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
    let _ = stream.set_nodelay(true);
    match tls {
        None => Ok(Stream::Plain(stream)),
        Some(tls) => tls.connect(stream, address, expected).await,
    }
}

/// Connect to the element at `address` as [`connect`] does, but over its local socket
/// (`crate::local_socket`) when `local` allows, the address is a loopback one and the element
/// listens there; over TCP otherwise.
pub async fn connect_element(
    address: SocketAddr,
    tls: Option<&TlsContext>,
    expected: &[Role],
    timeout: std::time::Duration,
    local: bool,
) -> Result<Stream, String> {
    let stream = match local {
        true => crate::local_socket::connect(address).await,
        false => None,
    };
    let Some(stream) = stream else { return connect(address, tls, expected, timeout).await };
    match tls {
        None => Ok(Stream::Local(stream)),
        Some(tls) => tls.connect(stream, address, expected).await,
    }
}

/// Open a far-link session to an element (UDP with FEC), then TLS if `tls` is given.
pub async fn connect_far(
    address: SocketAddr,
    options: crate::far_link::FarLinkOptions,
    tls: Option<&TlsContext>,
    expected: &[Role],
    timeout: std::time::Duration,
) -> Result<Stream, String> {
    let stream = crate::far_link::connect(address, options, timeout).await?;
    match tls {
        None => Ok(Stream::Fec(stream)),
        Some(tls) => tls.connect(stream, address, expected).await,
    }
}

/// Servers refuse to listen beyond loopback without TLS unless told `--insecure`.
pub fn check_listen(what: &str, address: SocketAddr, tls: bool, insecure: bool) -> Result<(), String> {
    if tls || insecure || address.ip().is_loopback() {
        return Ok(());
    }
    Err(format!(
        "refusing to serve {what} on {address} without TLS: anyone who reaches it could read and \
         overwrite volumes. Give --tls-dir (make certificates with `starfish certs init`), or \
         --insecure if the network is otherwise protected"
    ))
}

pub mod certs;

#[cfg(test)]
mod tests {
    use super::certs::{Subject, Validity};
    use super::*;

    fn cluster(tag: &str, subjects: &[(Role, &str)], validity: Validity) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("starfish-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let subjects: Vec<Subject> = subjects.iter().map(|(role, name)| Subject::parse(*role, name).unwrap()).collect();
        certs::init(&dir, &subjects, validity).unwrap();
        dir
    }

    /// Serve one TLS handshake with `server` (client certificate required); the client side's
    /// result, and the server side's.
    async fn handshake(
        server: &TlsContext,
        client: &TlsContext,
        expected: &[Role],
    ) -> (Result<(), String>, Result<Option<Identity>, String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = server.clone();
        let accepted = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            server.accept(stream, PeerCertificate::Required).await.map(|(_, identity)| identity)
        });
        let tcp = TcpStream::connect(address).await.unwrap();
        let connected = client.connect(tcp, address, expected).await.map(|_| ());
        (connected, accepted.await.unwrap())
    }

    #[tokio::test]
    async fn peers_are_told_apart_by_role_and_strangers_refused() {
        let dir = cluster("roles", &[(Role::Host, "he"), (Role::Element, "near")], Validity::days(2));
        let other = cluster("other", &[(Role::Element, "near")], Validity::days(2));
        let host = TlsContext::load(&dir.join("he")).unwrap();
        let element = TlsContext::load(&dir.join("near")).unwrap();
        let foreign = TlsContext::load(&other.join("near")).unwrap();

        // A host element reaching an element: both learn who the other is.
        let (client, server) = handshake(&element, &host, &[Role::Element]).await;
        client.unwrap();
        assert_eq!(server.unwrap(), Some(Identity { role: Role::Host, name: "he".into() }));
        // An element told to copy from an address that answers with a host element's
        // certificate (not a peer element): refused before anything is sent.
        let (client, _) = handshake(&host, &element, &[Role::Element]).await;
        assert!(client.unwrap_err().contains("not of a element"));
        // Another cluster's element: it does not trust this cluster's CA either, and gives up;
        // the server learns why.
        let (client, server) = handshake(&element, &foreign, &[Role::Element]).await;
        assert!(client.unwrap_err().contains("not signed by this cluster's CA"));
        let reason = server.unwrap_err();
        assert!(reason.contains("refused our certificate"), "{reason}");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&other).unwrap();
    }

    #[tokio::test]
    async fn an_expired_certificate_is_refused_saying_so() {
        let dir = cluster("expired", &[(Role::Element, "near")], Validity::days(2));
        let old = [Subject::parse(Role::Host, "old").unwrap()];
        certs::add(&dir, &old, Validity::until("2020-01-01").unwrap()).unwrap();
        let element = TlsContext::load(&dir.join("near")).unwrap();
        let expired = TlsContext::load(&dir.join("old")).unwrap();
        // TLS 1.3: the client is done before the server checks its certificate; the server's
        // refusal is what counts (the client's first read fails).
        let (_, server) = handshake(&element, &expired, &[Role::Element]).await;
        let reason = server.unwrap_err();
        assert!(reason.contains("expired"), "{reason}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_incomplete_directory_is_named() {
        let error = TlsContext::load(Path::new("/nonexistent/tls")).unwrap_err();
        assert!(error.contains("/nonexistent/tls") && error.contains("starfish certs init"), "{error}");
        let dir = cluster("incomplete", &[(Role::Element, "near")], Validity::days(2));
        std::fs::remove_file(dir.join("near/key.pem")).unwrap();
        let error = TlsContext::load(&dir.join("near")).unwrap_err();
        assert!(error.contains("no private key"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
