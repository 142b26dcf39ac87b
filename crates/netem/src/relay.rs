//! The userspace relay between two TUN devices: per direction, a reader thread takes each IP
//! packet the kernel routes into one device, asks the [`PathModel`] for its fate, and queues it;
//! a writer thread sleeps until the packet is due and writes it into the other device, where
//! the kernel receives it. Threads rather than async tasks: a blocked thread wakes within
//! microseconds of its deadline (with timer slack lowered), the runtime's timer wheel only
//! within a millisecond.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::limits::{PACKET_BYTES_MAX, STOP_POLL_MS};
use crate::model::{PathModel, Verdict};
use crate::params::LinkParams;
use crate::sys::{self, StopEvent, Wait};

/// The model of one direction, shared by its reader and writer and by the link's handle.
pub type SharedModel = Arc<Mutex<PathModel>>;

pub fn lock(model: &SharedModel) -> MutexGuard<'_, PathModel> {
    // A panic in a relay thread is a bug that already crashed loudly; keep serving the data.
    model.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[derive(Debug)]
pub struct Relay {
    stop: Arc<StopEvent>,
    threads: Vec<JoinHandle<()>>,
}

/// A packet on the wire: when it is due (ns since the epoch) and its bytes.
type InFlight = (u64, Vec<u8>);

impl Relay {
    /// Starts relaying between `a` and `b`; `models[0]` shapes a→b, `models[1]` b→a.
    pub fn start(a: Arc<OwnedFd>, b: Arc<OwnedFd>, models: [SharedModel; 2], seed: u64) -> std::io::Result<Relay> {
        let stop = Arc::new(StopEvent::new()?);
        let epoch = Instant::now();
        let mut threads = Vec::new();
        let [model_ab, model_ba] = models;
        for (label, from, to, model, seed) in
            [("a>b", a.clone(), b.clone(), model_ab, seed), ("b>a", b, a, model_ba, seed ^ 0x9e37_79b9_7f4a_7c15)]
        {
            let (tx, rx) = mpsc::channel::<InFlight>();
            let (reader_stop, reader_model) = (stop.clone(), model.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sfn-relay-{label}-read"))
                    .spawn(move || read_packets(&from, &reader_model, &tx, epoch, seed, &reader_stop))?,
            );
            let writer_stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sfn-relay-{label}-write"))
                    .spawn(move || write_packets(&to, &model, &rx, epoch, &writer_stop))?,
            );
        }
        Ok(Relay { stop, threads })
    }

    /// Stops all threads and waits for them; packets still on the wire are dropped.
    pub fn stop(&mut self) {
        self.stop.stop();
        for thread in self.threads.drain(..) {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop();
        }
    }
}

fn read_packets(
    from: &OwnedFd,
    model: &SharedModel,
    tx: &mpsc::Sender<InFlight>,
    epoch: Instant,
    seed: u64,
    stop: &StopEvent,
) {
    sys::set_realtime_priority();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; PACKET_BYTES_MAX];
    loop {
        match sys::read(from.as_raw_fd(), &mut buf) {
            Ok(0) => return,
            Ok(n) => {
                let now = Instant::now();
                let now_ns = (now - epoch).as_nanos() as u64;
                let verdict = lock(model).handle_packet(now_ns, n as u64, &mut rng);
                if let Verdict::Deliver { at_ns } = verdict {
                    if tx.send((at_ns, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match sys::wait_readable(from.as_raw_fd(), stop, -1) {
                    Ok(Wait::Readable | Wait::TimedOut) => {}
                    Ok(Wait::Stopped) => return,
                    Err(e) => {
                        tracing::error!(error = %e, "relay: poll on a TUN device failed");
                        return;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::error!(error = %e, "relay: reading a TUN device failed");
                return;
            }
        }
    }
}

fn write_packets(to: &OwnedFd, model: &SharedModel, rx: &mpsc::Receiver<InFlight>, epoch: Instant, stop: &StopEvent) {
    sys::set_timer_slack_ns(1);
    sys::set_realtime_priority();
    let stop_poll = Duration::from_millis(STOP_POLL_MS);
    loop {
        let (at_ns, packet) = match rx.recv_timeout(stop_poll) {
            Ok(item) => item,
            Err(mpsc::RecvTimeoutError::Timeout) if !stop.is_stopped() => continue,
            Err(_) => break,
        };
        let due = epoch + Duration::from_nanos(at_ns);
        // Sleep in slices so that a stop is noticed while holding a long delay.
        loop {
            if stop.is_stopped() {
                lock(model).handle_abandoned(1 + rx.try_iter().count() as u64);
                return;
            }
            let now = Instant::now();
            if now >= due {
                break;
            }
            sys::sleep_until(now + (due - now).min(stop_poll));
        }
        let now_ns = (Instant::now() - epoch).as_nanos() as u64;
        if lock(model).handle_due(now_ns, at_ns, packet.len() as u64) {
            // A TUN write hands the packet to the kernel at once; an error (the device went
            // down) is a lost packet, which TCP recovers from.
            if let Err(e) = sys::write(to.as_raw_fd(), &packet) {
                tracing::debug!(error = %e, "relay: writing a TUN device failed");
            }
        }
    }
    lock(model).handle_abandoned(rx.try_iter().count() as u64);
}

/// A model per direction, both with `params`.
pub fn models(params: LinkParams) -> [SharedModel; 2] {
    [Arc::new(Mutex::new(PathModel::new(params))), Arc::new(Mutex::new(PathModel::new(params)))]
}
