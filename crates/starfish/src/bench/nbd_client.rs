//! A small blocking NBD client for benchmarks that must know exactly which writes were
//! acknowledged and when (fio reports aggregates only): fixed newstyle, `NBD_OPT_GO`, simple
//! replies, reads, and pipelined writes with a chosen queue depth.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const FLAG_C_NO_ZEROES: u32 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const INFO_EXPORT: u16 = 0;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;

pub struct NbdClient {
    stream: TcpStream,
    next_handle: u64,
}

/// One write's fate: when it was sent and when (if) its answer came.
#[derive(Clone, Copy, Debug)]
pub struct WriteOutcome {
    pub index: u64,
    pub sent: Instant,
    pub answered: Option<Instant>,
    pub ok: bool,
}

impl NbdClient {
    pub fn connect(address: SocketAddr, export: &str, timeout: Duration) -> Result<NbdClient> {
        let mut stream = TcpStream::connect_timeout(&address, timeout).with_context(|| format!("NBD {address}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut hello = [0u8; 18];
        stream.read_exact(&mut hello).context("NBD greeting")?;
        if u64::from_be_bytes(hello[..8].try_into()?) != NBDMAGIC
            || u64::from_be_bytes(hello[8..16].try_into()?) != IHAVEOPT
        {
            bail!("{address} is not a newstyle NBD server");
        }
        stream.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
        let mut option = Vec::new();
        option.extend_from_slice(&IHAVEOPT.to_be_bytes());
        option.extend_from_slice(&OPT_GO.to_be_bytes());
        option.extend_from_slice(&(4 + export.len() as u32 + 2).to_be_bytes());
        option.extend_from_slice(&(export.len() as u32).to_be_bytes());
        option.extend_from_slice(export.as_bytes());
        option.extend_from_slice(&0u16.to_be_bytes());
        stream.write_all(&option)?;
        let mut size_bytes = None;
        loop {
            let mut head = [0u8; 20];
            stream.read_exact(&mut head).context("NBD option reply")?;
            if u64::from_be_bytes(head[..8].try_into()?) != OPTION_REPLY_MAGIC {
                bail!("bad NBD option reply magic");
            }
            let reply = u32::from_be_bytes(head[12..16].try_into()?);
            let length = u32::from_be_bytes(head[16..20].try_into()?) as usize;
            let mut data = vec![0u8; length];
            stream.read_exact(&mut data)?;
            match reply {
                REP_ACK => break,
                REP_INFO if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    size_bytes = Some(u64::from_be_bytes(data[2..10].try_into()?));
                }
                REP_INFO => {}
                error if error & 0x8000_0000 != 0 => {
                    bail!("export {export:?} refused: {}", String::from_utf8_lossy(&data))
                }
                other => bail!("unexpected NBD option reply {other}"),
            }
        }
        if size_bytes.is_none() {
            bail!("the server named no export size");
        }
        Ok(NbdClient { stream, next_handle: 1 })
    }

    fn send(&mut self, command: u16, offset: u64, length: u32, data: &[u8]) -> Result<u64> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut request = Vec::with_capacity(28 + data.len());
        request.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        request.extend_from_slice(&0u16.to_be_bytes());
        request.extend_from_slice(&command.to_be_bytes());
        request.extend_from_slice(&handle.to_be_bytes());
        request.extend_from_slice(&offset.to_be_bytes());
        request.extend_from_slice(&length.to_be_bytes());
        request.extend_from_slice(data);
        self.stream.write_all(&request)?;
        Ok(handle)
    }

    /// The next simple reply: (handle, error).
    fn reply(&mut self) -> Result<(u64, u32)> {
        let mut head = [0u8; 16];
        self.stream.read_exact(&mut head)?;
        if u32::from_be_bytes(head[..4].try_into()?) != SIMPLE_REPLY_MAGIC {
            bail!("bad NBD reply magic");
        }
        Ok((u64::from_be_bytes(head[8..16].try_into()?), u32::from_be_bytes(head[4..8].try_into()?)))
    }

    pub fn read(&mut self, offset: u64, length: u32) -> Result<Vec<u8>> {
        let handle = self.send(CMD_READ, offset, length, &[])?;
        let (answered, error) = self.reply()?;
        if answered != handle || error != 0 {
            bail!("read of {length} bytes at {offset}: error {error}");
        }
        let mut data = vec![0u8; length as usize];
        self.stream.read_exact(&mut data)?;
        Ok(data)
    }

    /// Write `count` blocks of `block_bytes` (block `i` at `i × block_bytes`, its content made by
    /// `content(i)`), up to `depth` in flight, until `count` are sent or `stop()` says so.
    /// Returns every write sent, with its answer; a connection that breaks ends the run (the
    /// writes still unanswered are returned without an answer).
    pub fn write_blocks(
        &mut self,
        count: u64,
        block_bytes: u32,
        depth: usize,
        content: impl Fn(u64) -> Vec<u8>,
        stop: impl Fn() -> bool,
    ) -> Vec<WriteOutcome> {
        let mut outcomes: Vec<WriteOutcome> = Vec::new();
        let mut in_flight: HashMap<u64, usize> = HashMap::new();
        let mut next = 0u64;
        loop {
            while in_flight.len() < depth && next < count && !stop() {
                let data = content(next);
                let Ok(handle) = self.send(CMD_WRITE, next * block_bytes as u64, block_bytes, &data) else {
                    return outcomes;
                };
                in_flight.insert(handle, outcomes.len());
                outcomes.push(WriteOutcome { index: next, sent: Instant::now(), answered: None, ok: false });
                next += 1;
            }
            if in_flight.is_empty() {
                return outcomes;
            }
            let Ok((handle, error)) = self.reply() else { return outcomes };
            let Some(at) = in_flight.remove(&handle) else { return outcomes };
            outcomes[at].answered = Some(Instant::now());
            outcomes[at].ok = error == 0;
        }
    }

    pub fn disconnect(mut self) {
        let _ = self.send(CMD_DISC, 0, 0, &[]);
    }
}
