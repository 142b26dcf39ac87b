//! The error values NBD allows on the wire. The spec restricts them to a fixed set whose numbers
//! are the common Linux `errno` values; anything else a backend hits must be mapped to one.

/// An NBD error value, as sent in a simple reply's error field or an error chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u32)]
pub enum Errno {
    /// Operation not permitted: a write or trim to a read-only export.
    #[error("EPERM: operation not permitted")]
    Perm = 1,
    /// Input/output error.
    #[error("EIO: input/output error")]
    Io = 5,
    /// Cannot allocate memory (the spec asks servers to avoid it).
    #[error("ENOMEM: cannot allocate memory")]
    NoMem = 12,
    /// Invalid argument: bad flags, misaligned or out-of-range request, unknown command.
    #[error("EINVAL: invalid argument")]
    Inval = 22,
    /// No space left on device: a write past the end of the export.
    #[error("ENOSPC: no space left on device")]
    NoSpc = 28,
    /// Value too large (only for `NBD_CMD_FLAG_DF` reads).
    #[error("EOVERFLOW: value too large")]
    Overflow = 75,
    /// Operation not supported (only for `NBD_CMD_FLAG_FAST_ZERO`).
    #[error("ENOTSUP: operation not supported")]
    NotSup = 95,
    /// Server is shutting down; the client must disconnect.
    #[error("ESHUTDOWN: server is shutting down")]
    Shutdown = 108,
}

impl Errno {
    /// The number sent on the wire.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The error for a wire number, if it is one the spec defines.
    pub fn from_code(code: u32) -> Option<Errno> {
        Some(match code {
            1 => Errno::Perm,
            5 => Errno::Io,
            12 => Errno::NoMem,
            22 => Errno::Inval,
            28 => Errno::NoSpc,
            75 => Errno::Overflow,
            95 => Errno::NotSup,
            108 => Errno::Shutdown,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for (errno, code) in [
            (Errno::Perm, 1),
            (Errno::Io, 5),
            (Errno::NoMem, 12),
            (Errno::Inval, 22),
            (Errno::NoSpc, 28),
            (Errno::Overflow, 75),
            (Errno::NotSup, 95),
            (Errno::Shutdown, 108),
        ] {
            assert_eq!(errno.code(), code);
            assert_eq!(Errno::from_code(code), Some(errno));
        }
        assert_eq!(Errno::from_code(0), None);
        assert_eq!(Errno::from_code(2), None);
    }
}
