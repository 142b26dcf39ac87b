//! The I/O shell: the only crate with tokio, sockets, files and the clock. It turns socket
//! and disk events into inputs of the sans-IO cores and carries out the actions they emit.

mod accept;
pub mod admin;
pub mod coordination;
mod copy;
pub mod element;
pub mod far_link;
pub mod host;
mod lending;
mod local_socket;
mod low_water;
mod metrics;
pub mod nbd_server;
pub mod node;
mod outgoing;
mod status_page;
pub mod tls;
mod volumes;
