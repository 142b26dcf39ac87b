//! The TCP proxy mode, unprivileged: delay, rate, cut/heal, run-time changes, teardown. Only
//! bounds that a loaded machine cannot break are asserted (never earlier, never faster than
//! configured); how close to the configuration it stays is measured in tests/fidelity.rs.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use common::{arrives_within, data, echo_server, ping, send_all, sink_server, TIMEOUT};
use netem::{LinkError, LinkParams, ParamsError, Proxy};

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().expect("valid")
}

fn delay(ms: f64) -> LinkParams {
    LinkParams { delay_ms_one_way: ms, ..LinkParams::default() }
}

fn echo_through(params: LinkParams, connections: usize) -> (Proxy, std::thread::JoinHandle<()>) {
    let server = TcpListener::bind(local()).expect("bind");
    let target = server.local_addr().expect("address");
    let echo = echo_server(server, connections);
    (Proxy::start(local(), target, params).expect("proxy"), echo)
}

#[test]
fn round_trips_take_at_least_two_delays_and_keep_bytes() {
    let (proxy, _echo) = echo_through(delay(8.0), 1);
    let mut client = TcpStream::connect_timeout(&proxy.address(), TIMEOUT).expect("connect");
    for i in 0..20u8 {
        let rtt = ping(&mut client, &[i; 100]);
        assert!(rtt >= Duration::from_millis(16), "round trip {rtt:?} shorter than 2 × 8 ms");
    }
}

#[test]
fn bulk_transfer_is_intact_and_never_faster_than_the_rate() {
    let rate_mbit = 31.0;
    let server = TcpListener::bind(local()).expect("bind");
    let sink = sink_server(server.try_clone().expect("clone"));
    let params = LinkParams { rate_mbit: Some(rate_mbit), delay_ms_one_way: 1.0, ..LinkParams::default() };
    let proxy = Proxy::start(local(), server.local_addr().expect("address"), params).expect("proxy");
    let sent = data(3_000_000);
    let mut client = TcpStream::connect_timeout(&proxy.address(), TIMEOUT).expect("connect");
    let start = send_all(&mut client, &sent);
    let (received, last) = sink.join().expect("sink");
    assert!(received == sent, "the bytes arrive intact and in order");
    // The serialiser cannot deliver N bytes in less than N / rate after the first one entered.
    let floor = Duration::from_secs_f64(sent.len() as f64 * 8.0 / (rate_mbit * 1e6));
    assert!(last - start >= floor, "{} bytes in {:?}: faster than {rate_mbit} Mbit/s", sent.len(), last - start);
    assert_eq!(proxy.stats().a_to_b.bytes_delivered, sent.len() as u64);
}

#[test]
fn cut_holds_bytes_and_heal_delivers_them_on_the_same_connection() {
    let (proxy, _echo) = echo_through(delay(2.0), 1);
    let mut client = TcpStream::connect_timeout(&proxy.address(), TIMEOUT).expect("connect");
    ping(&mut client, b"before");
    proxy.cut();
    assert!(proxy.is_cut());
    std::io::Write::write_all(&mut client, b"during").expect("write");
    assert!(!arrives_within(&mut client, Duration::from_millis(500)), "nothing crosses a cut link");
    proxy.heal();
    let mut echo = [0u8; 6];
    client.read_exact(&mut echo).expect("the held bytes arrive after the heal");
    assert_eq!(&echo, b"during");
    ping(&mut client, b"after");
}

#[test]
fn set_changes_the_delay_of_a_live_connection() {
    let (proxy, _echo) = echo_through(delay(1.0), 1);
    let mut client = TcpStream::connect_timeout(&proxy.address(), TIMEOUT).expect("connect");
    ping(&mut client, b"short");
    proxy.set(delay(25.0)).expect("valid");
    assert_eq!(proxy.params().delay_ms_one_way, 25.0);
    let rtt = ping(&mut client, b"long");
    assert!(rtt >= Duration::from_millis(50), "round trip {rtt:?} after raising the delay to 25 ms");
}

#[test]
fn loss_is_refused_and_drop_closes_connections() {
    let (proxy, _echo) = echo_through(delay(0.0), 1);
    let lossy = LinkParams { loss_percent: 1.0, ..LinkParams::default() };
    assert!(matches!(proxy.set(lossy), Err(LinkError::Params(ParamsError::LossInProxy))));
    assert!(matches!(Proxy::start(local(), proxy.address(), lossy), Err(LinkError::Params(ParamsError::LossInProxy))));
    let mut client = TcpStream::connect_timeout(&proxy.address(), TIMEOUT).expect("connect");
    ping(&mut client, b"x");
    drop(proxy);
    client.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut byte = [0u8; 1];
    let closed = matches!(client.read(&mut byte), Ok(0) | Err(_));
    assert!(closed, "dropping the proxy closes its connections");
}
