//! The metadata file: epoch, volumes, and the last committed checkpoint. Replaced atomically
//! (write a temporary file, sync, rename, sync the directory); its rename commits a checkpoint.

use std::{fs, io::Write, path::Path};

use proto::{Epoch, HostId, Sequence};

use crate::{error::io_error, sys, StoreError, VOLUMES_MAX, VOLUME_NAME_BYTES_MAX};

pub const META_FILE: &str = "meta";
const META_TEMP_FILE: &str = "meta.tmp";
const META_MAGIC: [u8; 8] = *b"SFSTMETA";
/// 2: log segments start with a segment header; `log_start` may be followed by several
/// segments written since the checkpoint.
/// 3: the host element holding the epoch, and the element's identity (version 2 is read:
/// holder unknown, identity chosen at the next open).
/// 4: a volume may be a snapshot of another (a flag byte after the name; versions 2 and 3 are
/// read as having none).
/// 5: a volume may be a clone of a snapshot (a second flag byte; older versions have none).
/// 6: the log may hold beginning records (kind 6), which older builds do not read; the file
/// itself is as in version 5 (read the same).
/// 7: the log may hold placed writes (write records flagged 4, without their data), which
/// older builds do not read; the file itself is as in version 5 (read the same).
/// 8: the log may hold copies of placed writes' data (kind 7), which older builds do not read;
/// the file itself is as in version 5 (read the same).
const META_VERSION: u32 = 8;
const META_VERSION_OLDEST: u32 = 2;
const META_HEADER_BYTES: usize = 24;
const META_VOLUME_BYTES_MIN: usize = 4 + 4 + 8 + 8 + 8 + 2;
/// A snapshot's flag byte and its parent number, sequence and id.
const META_SNAPSHOT_BYTES: usize = 1 + 4 + 8 + 8;
/// A clone's flag byte and its base snapshot's number.
const META_CLONE_BYTES: usize = 1 + 4;
const META_BYTES_MAX: usize = META_HEADER_BYTES
    + 48
    + VOLUMES_MAX * (META_VOLUME_BYTES_MIN + META_SNAPSHOT_BYTES + META_CLONE_BYTES + VOLUME_NAME_BYTES_MAX);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub epoch: Epoch,
    /// The host element `epoch` belongs to (`HostId(0)`: not known).
    pub epoch_holder: HostId,
    /// This element's identity, random at creation: the same element reached under two names
    /// is recognised by it (0: not chosen yet, a version-2 file).
    pub element_id: u64,
    /// Generation of the last committed checkpoint (0: none yet).
    pub generation: u64,
    /// The first log segment not covered by the checkpoint: every record after the
    /// checkpoint is in it or in the segments after it.
    pub log_start: u64,
    pub next_volume_number: u32,
    pub volumes: Vec<VolumeMeta>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeMeta {
    pub number: u32,
    pub name: String,
    pub size_bytes: u64,
    /// Applied sequence of the volume at the checkpoint its block map images describe.
    pub applied: Sequence,
    /// Epoch of the record of that sequence.
    pub applied_epoch: Epoch,
    /// Digest of the chunk generations of its block map at the checkpoint.
    pub map_digest: u32,
    /// Set if the volume is a snapshot of another.
    pub snapshot_of: Option<SnapshotOf>,
    /// Set if the volume is a live clone of a snapshot: the snapshot's volume number. A block
    /// the clone does not own (see `Volume::owns`) reads through that snapshot.
    pub clone_of: Option<u32>,
}

/// What makes a volume a snapshot: the live volume it was taken of, at which sequence of it,
/// and under which id (the host element's). A snapshot volume holds only the blocks it
/// preserved (see `Store::commit`); the rest it reads through its newer snapshots and the
/// live volume. Its own sequence counts its preserving records, not the live volume's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotOf {
    /// Number of the live volume.
    pub parent: u32,
    /// The live volume's sequence of the snapshot record: the snapshot holds its content
    /// with every record up to this one applied, and none after.
    pub taken_at: Sequence,
    pub id: u64,
}

impl Meta {
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&self.epoch.0.to_le_bytes());
        body.extend_from_slice(&self.epoch_holder.0.to_le_bytes());
        body.extend_from_slice(&self.element_id.to_le_bytes());
        body.extend_from_slice(&self.generation.to_le_bytes());
        body.extend_from_slice(&self.log_start.to_le_bytes());
        body.extend_from_slice(&self.next_volume_number.to_le_bytes());
        body.extend_from_slice(&(self.volumes.len() as u32).to_le_bytes());
        for volume in &self.volumes {
            body.extend_from_slice(&volume.number.to_le_bytes());
            body.extend_from_slice(&volume.map_digest.to_le_bytes());
            body.extend_from_slice(&volume.size_bytes.to_le_bytes());
            body.extend_from_slice(&volume.applied.0.to_le_bytes());
            body.extend_from_slice(&volume.applied_epoch.0.to_le_bytes());
            assert!(volume.name.len() <= VOLUME_NAME_BYTES_MAX, "volume names are checked on creation");
            body.extend_from_slice(&(volume.name.len() as u16).to_le_bytes());
            body.extend_from_slice(volume.name.as_bytes());
            match volume.snapshot_of {
                None => body.push(0),
                Some(snapshot) => {
                    body.push(1);
                    body.extend_from_slice(&snapshot.parent.to_le_bytes());
                    body.extend_from_slice(&snapshot.taken_at.0.to_le_bytes());
                    body.extend_from_slice(&snapshot.id.to_le_bytes());
                }
            }
            match volume.clone_of {
                None => body.push(0),
                Some(base) => {
                    body.push(1);
                    body.extend_from_slice(&base.to_le_bytes());
                }
            }
        }
        let mut out = Vec::with_capacity(META_HEADER_BYTES + body.len());
        out.extend_from_slice(&META_MAGIC);
        out.extend_from_slice(&META_VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&proto::crc32c(&body).to_le_bytes());
        let header_crc = proto::crc32c(&out[0..20]);
        out.extend_from_slice(&header_crc.to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Meta, String> {
        if bytes.len() < META_HEADER_BYTES {
            return Err(format!("{} bytes, shorter than its header", bytes.len()));
        }
        if bytes[0..8] != META_MAGIC {
            return Err("bad magic".into());
        }
        let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4"));
        if proto::crc32c(&bytes[0..20]) != u32_at(bytes, 20) {
            return Err("header checksum mismatch".into());
        }
        let version = u32_at(bytes, 8);
        if !(META_VERSION_OLDEST..=META_VERSION).contains(&version) {
            return Err(format!("format version {version}, this build reads {META_VERSION_OLDEST} to {META_VERSION}"));
        }
        let body_len = u32_at(bytes, 12) as usize;
        let body = &bytes[META_HEADER_BYTES..];
        if body.len() != body_len {
            return Err(format!("body of {} bytes, header says {body_len}", body.len()));
        }
        if proto::crc32c(body) != u32_at(bytes, 16) {
            return Err("body checksum mismatch".into());
        }
        let mut reader = Reader { bytes: body };
        let epoch = Epoch(reader.u64()?);
        let (epoch_holder, element_id) =
            if version >= 3 { (HostId(reader.u64()?), reader.u64()?) } else { (HostId(0), 0) };
        let generation = reader.u64()?;
        let log_start = reader.u64()?;
        let next_volume_number = reader.u32()?;
        let count = reader.u32()? as usize;
        if count > VOLUMES_MAX {
            return Err(format!("{count} volumes, more than {VOLUMES_MAX}"));
        }
        let mut volumes = Vec::with_capacity(count);
        for _ in 0..count {
            let number = reader.u32()?;
            let map_digest = reader.u32()?;
            let size_bytes = reader.u64()?;
            let applied = Sequence(reader.u64()?);
            let applied_epoch = Epoch(reader.u64()?);
            let name_len = reader.u16()? as usize;
            let name = String::from_utf8(reader.take(name_len)?.to_vec())
                .map_err(|_| "volume name is not UTF-8".to_string())?;
            if number >= next_volume_number {
                return Err(format!("volume number {number} not below the next number {next_volume_number}"));
            }
            let snapshot_of = match if version >= 4 { reader.take(1)?[0] } else { 0 } {
                0 => None,
                1 => Some(SnapshotOf { parent: reader.u32()?, taken_at: Sequence(reader.u64()?), id: reader.u64()? }),
                flag => return Err(format!("volume {number} has snapshot flag {flag}")),
            };
            let clone_of = match if version >= 5 { reader.take(1)?[0] } else { 0 } {
                0 => None,
                1 => Some(reader.u32()?),
                flag => return Err(format!("volume {number} has clone flag {flag}")),
            };
            volumes.push(VolumeMeta {
                number,
                name,
                size_bytes,
                applied,
                applied_epoch,
                map_digest,
                snapshot_of,
                clone_of,
            });
        }
        for volume in &volumes {
            if let Some(snapshot) = volume.snapshot_of {
                let parent = volumes.iter().find(|v| v.number == snapshot.parent);
                if !parent.is_some_and(|p| p.snapshot_of.is_none() && p.size_bytes >= volume.size_bytes) {
                    return Err(format!(
                        "volume {} is a snapshot of volume {}, which is not a live volume at least as large",
                        volume.number, snapshot.parent
                    ));
                }
            }
            if let Some(base) = volume.clone_of {
                let snapshot = volumes.iter().find(|v| v.number == base);
                // A base that is gone (a repair removed it) makes the clone a repair when the
                // store opens.
                if volume.snapshot_of.is_some()
                    || snapshot.is_some_and(|s| s.snapshot_of.is_none() || s.size_bytes > volume.size_bytes)
                {
                    return Err(format!(
                        "volume {} is a clone of volume {base}, which is not a snapshot at most as large, or it is a snapshot itself",
                        volume.number
                    ));
                }
            }
        }
        if !reader.bytes.is_empty() {
            return Err(format!("{} bytes left over", reader.bytes.len()));
        }
        Ok(Meta { epoch, epoch_holder, element_id, generation, log_start, next_volume_number, volumes })
    }

    /// Read `dir/meta`; `Ok(None)` if there is none.
    pub fn read(dir: &Path) -> Result<Option<Meta>, StoreError> {
        let path = dir.join(META_FILE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error("read metadata", &path)(e)),
        };
        if bytes.len() > META_BYTES_MAX {
            return Err(StoreError::CorruptMetadata { path, reason: format!("{} bytes, too large", bytes.len()) });
        }
        Meta::decode(&bytes).map(Some).map_err(|reason| StoreError::CorruptMetadata { path, reason })
    }

    /// Replace `dir/meta` atomically and durably.
    pub fn write(&self, dir: &Path) -> Result<(), StoreError> {
        let temp = dir.join(META_TEMP_FILE);
        let mut file = fs::File::create(&temp).map_err(io_error("create metadata", &temp))?;
        file.write_all(&self.encode()).map_err(io_error("write metadata", &temp))?;
        file.sync_data().map_err(io_error("sync metadata", &temp))?;
        drop(file);
        let path = dir.join(META_FILE);
        fs::rename(&temp, &path).map_err(io_error("rename metadata into", &path))?;
        sys::sync_dir(dir).map_err(io_error("sync directory", dir))
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.bytes.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let meta = Meta {
            epoch: Epoch(7),
            epoch_holder: HostId(0xabc),
            element_id: 42,
            generation: 3,
            log_start: 12,
            next_volume_number: 4,
            volumes: vec![
                VolumeMeta {
                    number: 0,
                    name: "a".into(),
                    size_bytes: 1 << 20,
                    applied: Sequence(5),
                    applied_epoch: Epoch(6),
                    map_digest: 9,
                    snapshot_of: None,
                    clone_of: None,
                },
                VolumeMeta {
                    number: 1,
                    name: "δ".into(),
                    size_bytes: 1 << 30,
                    applied: Sequence(0),
                    applied_epoch: Epoch(0),
                    map_digest: 0,
                    snapshot_of: None,
                    clone_of: None,
                },
                VolumeMeta {
                    number: 2,
                    name: "a@5".into(),
                    size_bytes: 1 << 20,
                    applied: Sequence(3),
                    applied_epoch: Epoch(6),
                    map_digest: 1,
                    snapshot_of: Some(SnapshotOf { parent: 0, taken_at: Sequence(4), id: 5 }),
                    clone_of: None,
                },
                VolumeMeta {
                    number: 3,
                    name: "c#9".into(),
                    size_bytes: 2 << 20,
                    applied: Sequence(2),
                    applied_epoch: Epoch(6),
                    map_digest: 4,
                    snapshot_of: None,
                    clone_of: Some(2),
                },
            ],
        };
        let bytes = meta.encode();
        assert_eq!(Meta::decode(&bytes), Ok(meta));
        for i in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[i] ^= 0x10;
            assert!(Meta::decode(&damaged).is_err(), "flip at {i} went unnoticed");
        }
        for len in 0..bytes.len() {
            assert!(Meta::decode(&bytes[..len]).is_err(), "truncation at {len} went unnoticed");
        }
    }
}
