//! NBD server driver (being written).
