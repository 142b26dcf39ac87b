//! The catalog of volumes created while running (`starfish volume create`) and the intention
//! log that makes creating one failure-atomic, as the Slice paper's coordinator does (section
//! 3): the intention is logged durably, then executed on the elements, then completed; a host
//! element that starts (after a crash, or taking over) finishes every intention it finds.
//!
//! The catalog lives where every host element finds it: in the storage volume
//! [`CATALOG_VOLUME`], replicated, fenced and recovered like any other, written whole at
//! offset 0 by one write (one record: all or nothing on every element) followed by a FLUSH
//! (durable on Q elements, whatever their ack policies). Its document:
//!
//! ```text
//! "SFCATLG4" | u32 body length | u32 crc32c(body) | body
//! body: u64 version | u64 next id | u32 n, n × volume | u32 m, m × intention
//!       | u32 k, k × snapshot [| u32 g, g × grown]
//! grown:     name (a group's storage volume) | u64 bytes (written only if g > 0)
//! volume:    name | u64 size_bytes | u64 id | u64 storage_bytes | origin
//! intention: u64 id | u8 kind | kind 1, create: name | u64 size_bytes | origin
//!                             | kind 2, delete: name | u64 volume id | u64 size_bytes | u64 storage_bytes
//!                                               | u32 j, j × snapshot (deleted with it) | origin
//!                             | kind 3, resize: name | u64 volume id | u64 from_bytes | u64 size_bytes
//!                                               | u64 storage_bytes
//!                             | kind 4, snapshot create: snapshot (its id is the intention's)
//!                             | kind 5, snapshot delete: snapshot
//! snapshot:  u64 id | name (the volume's) | u64 volume id (all ones: a configured volume)
//!            | name (the snapshot's) | u64 size_bytes | u64 taken_at
//! origin:    u8 0 (a volume created empty) | u8 1, snapshot (a clone of that snapshot)
//!            | u8 2, name (group) | name (its storage volume) | u64 offset (a member that
//!              joined that consistency group while running, at that offset of its storage)
//! name:      u16 length | UTF-8
//! ```
//!
//! `size_bytes` is the size exported over NBD; `storage_bytes` (at least as large) the size of
//! the storage volume on the elements, which never shrinks. A document of format 1
//! (`"SFCATLG1"`, no `storage_bytes`: nothing had shrunk) is read with `storage_bytes` equal to
//! the size (a resize's: the larger of its two sizes); one of format 2 (`"SFCATLG2"`) has no
//! snapshots, one of format 3 (`"SFCATLG3"`) no clones.
//!
//! A clone (`starfish volume clone VOLUME@NAME NEW`) is a volume created like any other, whose
//! entry (and creation's intention) names the snapshot it starts from: its storage volume's
//! spec carries the snapshot, so that every element creates it sharing the snapshot's blocks
//! (or, lacking the snapshot, empty for a full recovery to fill). A snapshot with clones is
//! not deleted, nor is its volume, until the clones are.
//!
//! A volume that joined a consistency group while running (`starfish volume create NAME SIZE
//! --group G`) has no storage volume of its own: its entry names the group, the group's
//! storage volume (`G[A,B]`, as configured) and its window's offset there, past every member
//! the group had and every snapshot of the group covers (so that no snapshot ever holds other
//! data under its name). Its `storage_bytes` is the group's storage size its join needs. Origin
//! 2 came after format 4 was first written: a reader that predates it refuses a catalog that
//! names a joined member, with that reason ("unknown origin 2"), and reads every other.
//!
//! A snapshot (`starfish snapshot create VOLUME NAME`) is taken by a record in its volume's
//! ordered stream (`Op::Snapshot` with the intention's id), so every element takes it at the
//! same point, and one that is down takes it when it catches up. Its intention is logged, the
//! record sent, and once Q elements hold it the completion lists the snapshot with `taken_at`,
//! a sequence at or after its record's (an element that has applied that far holds it). It is
//! exported read-only as `VOLUME@NAME`. A starting host element sends the record of a pending
//! snapshot again (an element that holds that id already takes nothing) and completes it. A
//! snapshot's deletion is a record too (`Op::SnapshotDelete`); the write that logs it drops the
//! snapshot's entry. A volume with snapshots is deleted only with them (`--with-snapshots`):
//! its deletion's intention keeps them, to list them again if it is undone.
//!
//! A deletion's intention leaves the volume's entry in the write that logs it; the intention
//! stays until every configured element has removed the storage volume (an element that was
//! down removes it when a host element's hello names it by a placeholder), then its
//! completion drops it. A starting host element serves every pending deletion's volume as
//! such a placeholder.
//!
//! A resize leaves the volume's entry at its old size until its completion. A grow past the
//! storage size is rolled forward by a starting host element: it serves the new size (the
//! elements grow the storage volume when the hello names it so). A shrink (`--shrink`) only
//! shrinks the export: the storage volume keeps its size, and the blocks past the new end are
//! zeroed through the ordered stream (freed on every element, including one that was down,
//! which gets the zeroing by recovery) before the completion is written. A starting host
//! element serves a pending shrink at its new size and zeroes that tail again before it
//! completes it. So the tail of a storage volume past its export always reads as zeroes, and a
//! later grow within the storage size only has to export more. Resizes are always logged:
//! with policy `none` they are refused, since an unlogged grow lost by a crash would leave
//! elements larger than any catalog says.
//!
//! A volume created while running is stored on the elements as `NAME#ID` (its intention's
//! id): a later volume of the same name is another storage volume, never old data. An
//! all-zero first block is the empty catalog of a new cluster.
//!
//! [`IntentionLog`] decides when the document is written: `single` writes each intention by
//! itself as soon as nothing else is being written; `group` (Slice's GROUP-COMMIT) waits up to
//! [`GROUP_WAIT_MS`] or until [`GROUP_BATCH`] intentions wait, and logs them with one write;
//! `none` logs nothing before executing (the paper's NONE: cheapest, and a crash between the
//! execution and the completion leaves a volume on the elements that no catalog names).

use std::collections::VecDeque;

use proto::{VolumeSpec, BLOCK_BYTES};

use crate::Time;

/// The storage volume that holds the catalog (a name no volume can take: it starts with a
/// dot).
pub const CATALOG_VOLUME: &str = ".catalog";
pub const CATALOG_VOLUME_BYTES: u64 = 16 << 20;
/// The largest volume an element's store holds (`store::VOLUME_BYTES_MAX`).
pub const VOLUME_BYTES_MAX: u64 = 16 << 40;
/// Longest name of a volume created while running (its storage name adds `#ID`).
pub const NAME_BYTES_MAX: usize = 200;
/// Group commit: an intention waits at most this long for others to share its write ...
pub const GROUP_WAIT_MS: u64 = 10;
/// ... or until this many wait.
pub const GROUP_BATCH: usize = 5;

const MAGIC: &[u8; 8] = b"SFCATLG4";
/// Format 3: no clones.
const MAGIC_V3: &[u8; 8] = b"SFCATLG3";
/// Format 2: no snapshots (read, never written).
const MAGIC_V2: &[u8; 8] = b"SFCATLG2";
/// Format 1: no storage sizes, no snapshots (read, never written).
const MAGIC_V1: &[u8; 8] = b"SFCATLG1";
const HEADER_BYTES: usize = 16;
const INTENT_CREATE: u8 = 1;
const INTENT_DELETE: u8 = 2;
const INTENT_RESIZE: u8 = 3;
const INTENT_SNAPSHOT_CREATE: u8 = 4;
const INTENT_SNAPSHOT_DELETE: u8 = 5;
/// The volume id of a snapshot of a configured volume (`--volume`), which no intention made.
pub const CONFIGURED_VOLUME_ID: u64 = u64::MAX;
/// Snapshots listed in the catalog, at most (each costs every element a block map).
pub const CATALOG_SNAPSHOTS_MAX: usize = 1024;

/// Every volume a host element serves: at most this many created while running.
pub const CATALOG_VOLUMES_MAX: usize = crate::limits::VOLUMES_MAX - 64;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Catalog {
    /// Changes written so far.
    pub version: u64,
    /// The next intention's id.
    pub next_id: u64,
    /// Volumes created (their intentions completed), in creation order.
    pub volumes: Vec<CatalogVolume>,
    /// Intentions logged and not completed: a starting host element finishes them.
    pub intentions: Vec<Intention>,
    /// Snapshots taken (their intentions completed), in id order.
    pub snapshots: Vec<CatalogSnapshot>,
    /// Storage volumes of configured consistency groups that grew as volumes joined them
    /// (joins completed), with their sizes: they never shrink, even when members leave.
    pub grown: Vec<(String, u64)>,
}

/// A snapshot of a volume, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogSnapshot {
    /// The id of the intention that took it: the id its record gave it on the elements.
    pub id: u64,
    /// The volume it was taken of (its export name) ...
    pub volume: String,
    /// ... and that volume's id ([`CONFIGURED_VOLUME_ID`]: a configured volume).
    pub volume_id: u64,
    pub name: String,
    /// The volume's exported size when it was taken: the snapshot's export size.
    pub size_bytes: u64,
    /// A sequence of the volume's storage volume at or after the snapshot's record (0 until
    /// it is taken).
    pub taken_at: u64,
}

impl CatalogSnapshot {
    /// Its read-only export: `VOLUME@NAME`.
    pub fn export_name(&self) -> String {
        format!("{}@{}", self.volume, self.name)
    }

    /// The storage volume of the volume it was taken of (a configured volume's is its name).
    pub fn storage_volume(&self) -> String {
        match self.volume_id {
            CONFIGURED_VOLUME_ID => self.volume.clone(),
            id => storage_name(&self.volume, id),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogVolume {
    pub name: String,
    /// The size exported over NBD.
    pub size_bytes: u64,
    /// The id of the intention that created it.
    pub id: u64,
    /// The size of its storage volume on the elements: at least `size_bytes` (larger after a
    /// shrink; the blocks past `size_bytes` read as zeroes).
    pub storage_bytes: u64,
    /// A clone: the snapshot it started from.
    pub clone_of: Option<CatalogSnapshot>,
    /// A member that joined a consistency group while running: its window there.
    pub member_of: Option<GroupWindow>,
}

/// Where a volume that joined a consistency group while running lies: at `offset_bytes` of
/// the group's storage volume `storage`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupWindow {
    pub group: String,
    pub storage: String,
    pub offset_bytes: u64,
}

impl CatalogVolume {
    /// A volume exported whole (its storage as large as its export).
    pub fn new(name: String, size_bytes: u64, id: u64) -> CatalogVolume {
        CatalogVolume { name, size_bytes, id, storage_bytes: size_bytes, clone_of: None, member_of: None }
    }

    /// A member of a consistency group: its window of the group's storage volume (from, to).
    pub fn window(&self) -> Option<(u64, u64)> {
        self.member_of.as_ref().map(|w| (w.offset_bytes, w.offset_bytes + self.size_bytes))
    }

    /// A member of a consistency group: its export, a window of the group's storage volume.
    pub fn joined(&self) -> Option<crate::groups::JoinedMember> {
        let w = self.member_of.as_ref()?;
        Some(crate::groups::JoinedMember {
            name: self.name.clone(),
            group: w.group.clone(),
            storage: w.storage.clone(),
            offset_bytes: w.offset_bytes,
            size_bytes: self.size_bytes,
        })
    }

    /// Its storage volume on the elements (a joined member's: the group's, at the size its
    /// join needs).
    pub fn spec(&self) -> VolumeSpec {
        if let Some(w) = &self.member_of {
            return VolumeSpec {
                name: w.storage.clone(),
                size_bytes: self.storage_bytes,
                clone_of: None,
                at_least: true,
            };
        }
        let clone_of = self.clone_of.as_ref().map(|s| proto::CloneBase { volume: s.storage_volume(), snapshot: s.id });
        VolumeSpec {
            name: storage_name(&self.name, self.id),
            size_bytes: self.storage_bytes,
            clone_of,
            at_least: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intention {
    pub id: u64,
    pub op: Intent,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Intent {
    /// Create volume `name`: empty, a clone of snapshot `clone_of`, or a window of a
    /// consistency group's storage volume (`member_of`; then `storage_bytes` is the group's
    /// storage size its join needs, else `size_bytes`).
    Create {
        name: String,
        size_bytes: u64,
        clone_of: Option<CatalogSnapshot>,
        member_of: Option<GroupWindow>,
        storage_bytes: u64,
    },
    /// Delete the volume `name` that intention `volume_id` created (of `size_bytes` exported
    /// and `storage_bytes` stored, kept to list it again if the deletion is undone before it
    /// was carried out), with its `snapshots` (`--with-snapshots`; kept the same way).
    Delete {
        name: String,
        volume_id: u64,
        size_bytes: u64,
        storage_bytes: u64,
        snapshots: Vec<CatalogSnapshot>,
        /// The volume is a clone of this snapshot (to list it again as one).
        clone_of: Option<CatalogSnapshot>,
        /// The volume is a member of a consistency group: its window (zeroed by the deletion).
        member_of: Option<GroupWindow>,
    },
    /// Export the volume `name` that intention `volume_id` created at `size_bytes` instead of
    /// `from_bytes`, its storage volume then being `storage_bytes` (grown if `size_bytes` is
    /// beyond it, else as it was).
    Resize { name: String, volume_id: u64, from_bytes: u64, size_bytes: u64, storage_bytes: u64 },
    /// Take this snapshot (its `id` is the intention's; `taken_at` is set once it is taken).
    SnapshotCreate { snapshot: CatalogSnapshot },
    /// Delete this snapshot (kept to list it again if the deletion is undone).
    SnapshotDelete { snapshot: CatalogSnapshot },
}

impl Intention {
    /// The volume it creates, deletes or resizes, as it is (or was) listed (a resize's at its
    /// new size). Not for a snapshot's intention ([`Intention::snapshot`]).
    pub fn volume(&self) -> CatalogVolume {
        match &self.op {
            Intent::Create { name, size_bytes, clone_of, member_of, storage_bytes } => CatalogVolume {
                clone_of: clone_of.clone(),
                member_of: member_of.clone(),
                storage_bytes: *storage_bytes,
                ..CatalogVolume::new(name.clone(), *size_bytes, self.id)
            },
            Intent::Delete { name, volume_id, size_bytes, storage_bytes, clone_of, member_of, .. } => CatalogVolume {
                name: name.clone(),
                size_bytes: *size_bytes,
                id: *volume_id,
                storage_bytes: *storage_bytes,
                clone_of: clone_of.clone(),
                member_of: member_of.clone(),
            },
            // A resize's intention does not name the volume's origin: `volumes_served` keeps
            // the listed one's.
            Intent::Resize { name, volume_id, size_bytes, storage_bytes, .. } => CatalogVolume {
                name: name.clone(),
                size_bytes: *size_bytes,
                id: *volume_id,
                storage_bytes: *storage_bytes,
                clone_of: None,
                member_of: None,
            },
            Intent::SnapshotCreate { .. } | Intent::SnapshotDelete { .. } => {
                unreachable!("a snapshot's intention is about a snapshot, not a volume")
            }
        }
    }

    /// The snapshot a snapshot's intention takes or deletes.
    pub fn snapshot(&self) -> Option<&CatalogSnapshot> {
        match &self.op {
            Intent::SnapshotCreate { snapshot } | Intent::SnapshotDelete { snapshot } => Some(snapshot),
            _ => None,
        }
    }

    pub fn is_snapshot(&self) -> bool {
        self.snapshot().is_some()
    }

    pub fn is_create(&self) -> bool {
        matches!(self.op, Intent::Create { .. })
    }

    pub fn is_delete(&self) -> bool {
        matches!(self.op, Intent::Delete { .. })
    }

    pub fn is_resize(&self) -> bool {
        matches!(self.op, Intent::Resize { .. })
    }

    /// A resize to a smaller export: it is completed only once the blocks past the new end
    /// are zeroed (see the module's documentation).
    pub fn is_shrink(&self) -> bool {
        matches!(self.op, Intent::Resize { from_bytes, size_bytes, .. } if size_bytes < from_bytes)
    }

    /// The id of the volume it is about (a creation's own; a snapshot's volume's,
    /// [`CONFIGURED_VOLUME_ID`] for a configured volume).
    pub fn volume_id(&self) -> u64 {
        match self.snapshot() {
            Some(snapshot) => snapshot.volume_id,
            None => self.volume().id,
        }
    }

    /// "create", "delete", "resize", "snapshot" or "snapshot-delete".
    pub fn kind(&self) -> &'static str {
        match self.op {
            Intent::Create { .. } => "create",
            Intent::Delete { .. } => "delete",
            Intent::Resize { .. } => "resize",
            Intent::SnapshotCreate { .. } => "snapshot",
            Intent::SnapshotDelete { .. } => "snapshot-delete",
        }
    }
}

/// The storage name of volume `name` created by intention `id`.
pub fn storage_name(name: &str, id: u64) -> String {
    format!("{name}#{id}")
}

/// The id of the intention that created a storage volume named by [`storage_name`] (0 for
/// any other name).
pub fn storage_id(storage: &str) -> u64 {
    storage.rsplit_once('#').and_then(|(_, id)| id.parse().ok()).unwrap_or(0)
}

/// Whether `name` may name a volume created while running: 1 to [`NAME_BYTES_MAX`] bytes of
/// letters, digits, `.`, `_` and `-`, not starting with a dot (those are the system's).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(format!("a volume name has 1 to {NAME_BYTES_MAX} bytes"));
    }
    if name.starts_with('.') {
        return Err(format!("volume name {name:?} starts with a dot: those are reserved"));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(format!("volume name {name:?} holds {c:?}: use letters, digits, '.', '_' and '-'"));
    }
    Ok(())
}

/// Whether volume `name` of `current` bytes may be resized to `size_bytes`, shrinking only if
/// asked to (`shrink`: `starfish volume resize --shrink`).
pub fn check_resize(name: &str, current: u64, size_bytes: u64, shrink: bool) -> Result<(), String> {
    if size_bytes == current {
        return Err(format!("volume {name} has {current} bytes already"));
    }
    if size_bytes < current && !shrink {
        return Err(format!(
            "volume {name} has {current} bytes: {size_bytes} would shrink it, and what is stored past that end \
             would be lost; pass --shrink to mean it"
        ));
    }
    if size_bytes > current && shrink {
        return Err(format!("--shrink asks for fewer bytes than volume {name} has ({current}), not {size_bytes}"));
    }
    Ok(())
}

/// Why no volume can join consistency group `group` (see [`Catalog::join_window`]).
pub fn group_too_large(group: &str) -> String {
    format!("consistency group {group} would grow beyond the largest volume, {VOLUME_BYTES_MAX} bytes")
}

/// Why member `name` of consistency group `group` cannot be resized.
pub fn member_resize_refusal(name: &str, group: &str) -> String {
    format!(
        "volume {name} is a member of consistency group {group}: resizing it would move the members after it; create a larger member and copy it over"
    )
}

/// Whether `size_bytes` may be the size of a new volume.
pub fn check_size(size_bytes: u64) -> Result<(), String> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err(format!("size {size_bytes} is not a positive multiple of {BLOCK_BYTES} bytes"));
    }
    if size_bytes > VOLUME_BYTES_MAX {
        return Err(format!("size {size_bytes} is beyond the largest volume, {VOLUME_BYTES_MAX} bytes (16 TiB)"));
    }
    Ok(())
}

impl Catalog {
    /// Whether a volume or an intention takes `name`.
    pub fn has_name(&self, name: &str) -> bool {
        self.volumes.iter().any(|v| v.name == name)
            || self.intentions.iter().any(|i| matches!(&i.op, Intent::Create { name: n, .. } if n == name))
    }

    /// The storage volumes of pending deletions: a starting host element serves them as
    /// placeholders, so that every element removes them.
    pub fn removed_to_serve(&self) -> Vec<String> {
        let deleted = self.intentions.iter().filter(|i| i.is_delete()).map(Intention::volume);
        deleted.filter(|v| v.member_of.is_none()).map(|v| v.spec().name).collect()
    }

    /// The volumes a starting host element serves: those created, and those of the
    /// intentions it finds (rolled forward: creations, and resizes at their new sizes), in id
    /// order.
    pub fn volumes_served(&self) -> Vec<CatalogVolume> {
        let mut all: Vec<CatalogVolume> = self.volumes.clone();
        for resize in self.intentions.iter().filter(|i| i.is_resize()) {
            let resized = resize.volume();
            for v in all.iter_mut().filter(|v| v.id == resized.id) {
                *v = CatalogVolume { clone_of: v.clone_of.take(), member_of: v.member_of.take(), ..resized.clone() };
            }
        }
        all.extend(self.intentions.iter().filter(|i| i.is_create()).map(Intention::volume));
        all.sort_by_key(|v| v.id);
        all
    }

    /// [`Catalog::volumes_served`] with storage volumes of their own, as pairs of (export
    /// name, storage).
    pub fn volumes_to_serve(&self) -> Vec<(String, VolumeSpec)> {
        let own = self.volumes_served().into_iter().filter(|v| v.member_of.is_none());
        own.map(|v| (v.name.clone(), v.spec())).collect()
    }

    /// [`Catalog::volumes_served`] that joined consistency groups while running: windows of
    /// their groups' storage volumes.
    pub fn members_to_serve(&self) -> Vec<crate::groups::JoinedMember> {
        self.volumes_served().iter().filter_map(CatalogVolume::joined).collect()
    }

    /// The sizes groups' storage volumes grew to (joins completed, and pending ones rolled
    /// forward): a starting host element serves them at least that large.
    pub fn groups_grown(&self) -> Vec<(String, u64)> {
        let mut grown = self.grown.clone();
        for v in self.intentions.iter().filter(|i| i.is_create()).map(Intention::volume) {
            if let Some(w) = &v.member_of {
                grow_entry(&mut grown, &w.storage, v.storage_bytes);
            }
        }
        grown
    }

    /// Where a member of `size_bytes` joining `group` (carried by `storage`, whose members end
    /// at `members_end`) would lie: its offset, at the next
    /// [`crate::groups::MEMBER_ALIGN_BYTES`] boundary past them and past [`Catalog::group_end`],
    /// and the storage size it needs. `None` past the largest volume.
    pub fn join_window(
        &self,
        group: &str,
        storage: &str,
        members_end: u64,
        size_bytes: u64,
        deleted: impl Fn(u64) -> bool,
    ) -> Option<(u64, u64)> {
        let align = crate::groups::MEMBER_ALIGN_BYTES;
        let offset_bytes = members_end.max(self.group_end(group, storage, deleted)).div_ceil(align) * align;
        let end = offset_bytes.checked_add(size_bytes).filter(|&end| end <= VOLUME_BYTES_MAX)?;
        Some((offset_bytes, end.max(self.grown_bytes(storage))))
    }

    /// What storage volume `storage` grew to by joins (0: none).
    pub fn grown_bytes(&self, storage: &str) -> u64 {
        self.groups_grown().iter().find(|(s, _)| s == storage).map_or(0, |(_, bytes)| *bytes)
    }

    /// Where the next member to join the group carried by storage volume `storage` may start
    /// (before rounding up to [`crate::groups::MEMBER_ALIGN_BYTES`]): past every member that
    /// joined it (listed, or being created or deleted) and every snapshot of `group`, so that a
    /// window a snapshot covers is never another volume's. `deleted(id)`: deletion `id` is
    /// carried out (its window zeroed), its completion not written yet: its window is free.
    pub fn group_end(&self, group: &str, storage: &str, deleted: impl Fn(u64) -> bool) -> u64 {
        let listed = self.volumes.iter().cloned();
        let pending = self.intentions.iter().filter(|i| i.is_create() || (i.is_delete() && !deleted(i.id)));
        let pending = pending.map(Intention::volume);
        let members = listed.chain(pending).filter_map(|v| {
            v.member_of.as_ref().filter(|w| w.storage == storage).map(|w| w.offset_bytes + v.size_bytes)
        });
        let snapshots = self.snapshots.iter().chain(self.intentions.iter().filter_map(Intention::snapshot));
        let covered =
            snapshots.filter(|s| s.volume == group && s.volume_id == CONFIGURED_VOLUME_ID).map(|s| s.size_bytes);
        members.chain(covered).max().unwrap_or(0)
    }

    /// The served volumes exported smaller than their storage volumes (shrunk): pairs of
    /// (storage name, exported size).
    pub fn exports_shrunk(&self) -> Vec<(String, u64)> {
        self.volumes_served()
            .into_iter()
            .filter(|v| v.member_of.is_none() && v.size_bytes < v.storage_bytes)
            .map(|v| (v.spec().name, v.size_bytes))
            .collect()
    }

    /// What a starting host element starts over with (`HostCore::restart_with_volumes`), in
    /// creation order: the volumes it serves, and the volumes of pending deletions as
    /// placeholders (size 0).
    pub fn volumes_to_restart(&self) -> Vec<(String, VolumeSpec)> {
        let mut all: Vec<(u64, String, VolumeSpec)> =
            self.volumes_to_serve().into_iter().map(|(name, spec)| (storage_id(&spec.name), name, spec)).collect();
        for i in self.intentions.iter().filter(|i| i.is_delete()) {
            let volume = i.volume();
            if volume.member_of.is_some() {
                continue; // A window of its group's storage volume, zeroed by the deletion.
            }
            let spec = VolumeSpec { name: volume.spec().name, size_bytes: 0, clone_of: None, at_least: false };
            all.push((volume.id, volume.name, spec));
        }
        all.sort_by_key(|(id, _, _)| *id);
        all.into_iter().map(|(_, name, spec)| (name, spec)).collect()
    }

    /// Finish every creation and grow as a starting host element does (its sessions carry
    /// them out by naming the volumes, at their sizes, in their hellos); deletions stay until
    /// every element confirmed, shrinks until their tails are zeroed again, snapshots until
    /// their records are sent again.
    pub fn roll_forward(&mut self) -> usize {
        let (done, pending): (Vec<Intention>, Vec<Intention>) = std::mem::take(&mut self.intentions)
            .into_iter()
            .partition(|i| !i.is_delete() && !i.is_shrink() && !i.is_snapshot());
        self.intentions = pending;
        let n = done.len();
        for i in &done {
            self.list_outcome(i, true);
        }
        n
    }

    /// What intention `i`, carried out (`done`) or undone, leaves listed: a creation carried
    /// out lists its volume, a deletion undone lists it again, a resize carried out lists it
    /// at its new sizes.
    fn list_outcome(&mut self, i: &Intention, done: bool) {
        match &i.op {
            Intent::Create { .. } | Intent::Delete { .. } if done == i.is_create() => {
                if let (true, Some(w)) = (i.is_create(), &i.volume().member_of) {
                    grow_entry(&mut self.grown, &w.storage, i.volume().storage_bytes);
                }
                self.volumes.push(i.volume());
                self.volumes.sort_by_key(|v| v.id);
                if let Intent::Delete { snapshots, .. } = &i.op {
                    self.snapshots.extend(snapshots.iter().cloned());
                    self.snapshots.sort_by_key(|s| s.id);
                }
            }
            Intent::SnapshotCreate { snapshot } | Intent::SnapshotDelete { snapshot }
                if done == matches!(i.op, Intent::SnapshotCreate { .. }) =>
            {
                self.snapshots.push(snapshot.clone());
                self.snapshots.sort_by_key(|s| s.id);
            }
            Intent::Resize { volume_id, size_bytes, storage_bytes, .. } if done => {
                for v in self.volumes.iter_mut().filter(|v| v.id == *volume_id) {
                    v.size_bytes = *size_bytes;
                    v.storage_bytes = v.storage_bytes.max(*storage_bytes);
                }
            }
            _ => {}
        }
    }

    /// What a deletion's intention, once logged, no longer lists: the volume and its
    /// snapshots, or the snapshot.
    fn drop_listed(&mut self, i: &Intention) {
        match &i.op {
            Intent::Delete { volume_id, .. } => {
                self.volumes.retain(|v| v.id != *volume_id);
                self.snapshots.retain(|s| s.volume_id != *volume_id);
            }
            Intent::SnapshotDelete { snapshot } => self.snapshots.retain(|s| s.id != snapshot.id),
            _ => {}
        }
    }

    /// The document, padded to whole blocks.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&self.version.to_le_bytes());
        body.extend_from_slice(&self.next_id.to_le_bytes());
        body.extend_from_slice(&(self.volumes.len() as u32).to_le_bytes());
        for v in &self.volumes {
            put_name(&mut body, &v.name);
            body.extend_from_slice(&v.size_bytes.to_le_bytes());
            body.extend_from_slice(&v.id.to_le_bytes());
            body.extend_from_slice(&v.storage_bytes.to_le_bytes());
            put_origin(&mut body, &v.clone_of, &v.member_of);
        }
        body.extend_from_slice(&(self.intentions.len() as u32).to_le_bytes());
        for i in &self.intentions {
            body.extend_from_slice(&i.id.to_le_bytes());
            match &i.op {
                Intent::Create { name, size_bytes, clone_of, member_of, storage_bytes } => {
                    body.push(INTENT_CREATE);
                    put_name(&mut body, name);
                    body.extend_from_slice(&size_bytes.to_le_bytes());
                    put_origin(&mut body, clone_of, member_of);
                    if member_of.is_some() {
                        body.extend_from_slice(&storage_bytes.to_le_bytes());
                    }
                }
                Intent::Delete { name, volume_id, size_bytes, storage_bytes, snapshots, clone_of, member_of } => {
                    body.push(INTENT_DELETE);
                    put_name(&mut body, name);
                    body.extend_from_slice(&volume_id.to_le_bytes());
                    body.extend_from_slice(&size_bytes.to_le_bytes());
                    body.extend_from_slice(&storage_bytes.to_le_bytes());
                    put_snapshots(&mut body, snapshots);
                    put_origin(&mut body, clone_of, member_of);
                }
                Intent::SnapshotCreate { snapshot } => {
                    body.push(INTENT_SNAPSHOT_CREATE);
                    put_snapshot(&mut body, snapshot);
                }
                Intent::SnapshotDelete { snapshot } => {
                    body.push(INTENT_SNAPSHOT_DELETE);
                    put_snapshot(&mut body, snapshot);
                }
                Intent::Resize { name, volume_id, from_bytes, size_bytes, storage_bytes } => {
                    body.push(INTENT_RESIZE);
                    put_name(&mut body, name);
                    body.extend_from_slice(&volume_id.to_le_bytes());
                    body.extend_from_slice(&from_bytes.to_le_bytes());
                    body.extend_from_slice(&size_bytes.to_le_bytes());
                    body.extend_from_slice(&storage_bytes.to_le_bytes());
                }
            }
        }
        put_snapshots(&mut body, &self.snapshots);
        if !self.grown.is_empty() {
            body.extend_from_slice(&(self.grown.len() as u32).to_le_bytes());
            for (storage, bytes) in &self.grown {
                put_name(&mut body, storage);
                body.extend_from_slice(&bytes.to_le_bytes());
            }
        }
        let mut out = Vec::with_capacity(HEADER_BYTES + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&proto::crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
        let padded = (out.len() as u64).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        out.resize(padded as usize, 0);
        assert!(padded <= CATALOG_VOLUME_BYTES, "the catalog fits its volume (bounded by CATALOG_VOLUMES_MAX)");
        out
    }

    /// How many bytes from offset 0 hold the document whose first block is `first` (`None`:
    /// an empty catalog).
    pub fn stored_bytes(first: &[u8]) -> Result<Option<u64>, String> {
        if first.len() < HEADER_BYTES {
            return Err("the catalog's first block is short".into());
        }
        if first.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        if ![MAGIC, MAGIC_V3, MAGIC_V2, MAGIC_V1].contains(&&first[..8].try_into().expect("8 bytes")) {
            return Err("the catalog volume does not start with a catalog (bad magic)".into());
        }
        let body = u32::from_le_bytes(first[8..12].try_into().expect("4 bytes")) as u64;
        let total = (HEADER_BYTES as u64 + body).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        if total > CATALOG_VOLUME_BYTES {
            return Err(format!("the catalog claims {total} bytes, more than its volume"));
        }
        Ok(Some(total))
    }

    /// The catalog a document holds (all zero: the empty catalog).
    pub fn decode(bytes: &[u8]) -> Result<Catalog, String> {
        let Some(total) = Catalog::stored_bytes(bytes)? else { return Ok(Catalog::default()) };
        if (bytes.len() as u64) < total {
            return Err("the catalog document is cut short".into());
        }
        let body_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        let body = &bytes[HEADER_BYTES..HEADER_BYTES + body_len];
        if proto::crc32c(body) != crc {
            return Err("the catalog document fails its checksum".into());
        }
        let v1 = &bytes[..8] == MAGIC_V1;
        // Formats 3 and 4 have snapshots; 4 has clones.
        let v4 = &bytes[..8] == MAGIC;
        let v3 = &bytes[..8] == MAGIC_V3 || v4;
        let origin = |r: &mut Reader| if v4 { r.origin() } else { Ok((None, None)) };
        let mut r = Reader { rest: body };
        // Format 1 has no storage sizes: each is the size (nothing had shrunk).
        let storage = |r: &mut Reader, size: u64| if v1 { Ok(size) } else { r.u64() };
        let version = r.u64()?;
        let next_id = r.u64()?;
        let n = r.count()?;
        let mut volumes = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.name()?;
            let size_bytes = r.u64()?;
            let id = r.u64()?;
            let storage_bytes = storage(&mut r, size_bytes)?;
            let (clone_of, member_of) = origin(&mut r)?;
            volumes.push(CatalogVolume { name, size_bytes, id, storage_bytes, clone_of, member_of });
        }
        let m = r.count()?;
        let mut intentions = Vec::with_capacity(m);
        for _ in 0..m {
            let id = r.u64()?;
            let op = match r.u8()? {
                INTENT_CREATE => {
                    let name = r.name()?;
                    let size_bytes = r.u64()?;
                    let (clone_of, member_of) = origin(&mut r)?;
                    let storage_bytes = if member_of.is_some() { r.u64()? } else { size_bytes };
                    Intent::Create { name, size_bytes, clone_of, member_of, storage_bytes }
                }
                INTENT_DELETE => {
                    let name = r.name()?;
                    let volume_id = r.u64()?;
                    let size_bytes = r.u64()?;
                    let storage_bytes = storage(&mut r, size_bytes)?;
                    let snapshots = if v3 { r.snapshots()? } else { Vec::new() };
                    let (clone_of, member_of) = origin(&mut r)?;
                    Intent::Delete { name, volume_id, size_bytes, storage_bytes, snapshots, clone_of, member_of }
                }
                INTENT_RESIZE => {
                    let name = r.name()?;
                    let volume_id = r.u64()?;
                    let from_bytes = r.u64()?;
                    let size_bytes = r.u64()?;
                    let storage_bytes = storage(&mut r, from_bytes.max(size_bytes))?;
                    Intent::Resize { name, volume_id, from_bytes, size_bytes, storage_bytes }
                }
                INTENT_SNAPSHOT_CREATE if v3 => Intent::SnapshotCreate { snapshot: r.snapshot()? },
                INTENT_SNAPSHOT_DELETE if v3 => Intent::SnapshotDelete { snapshot: r.snapshot()? },
                kind => return Err(format!("the catalog holds an intention of unknown kind {kind}")),
            };
            intentions.push(Intention { id, op });
        }
        let snapshots = if v3 { r.snapshots()? } else { Vec::new() };
        let mut grown = Vec::new();
        if v4 && !r.rest.is_empty() {
            let g = r.count()?;
            for _ in 0..g {
                let storage = r.name()?;
                let bytes = r.u64()?;
                if storage.is_empty() || storage.len() > 255 || bytes == 0 || !bytes.is_multiple_of(BLOCK_BYTES) {
                    return Err(format!(
                        "the catalog says group storage {storage:?} grew to {bytes} bytes, which cannot be"
                    ));
                }
                grown.push((storage, bytes));
            }
        }
        if !r.rest.is_empty() {
            return Err("the catalog document has bytes after its end".into());
        }
        let catalog = Catalog { version, next_id, volumes, intentions, snapshots, grown };
        catalog.check()?;
        Ok(catalog)
    }

    /// Names valid, sizes valid, ids below `next_id`; the volumes and creations distinct in
    /// name and id; every id used once (a deletion's own and its volume's, a snapshot's); the
    /// snapshots of a volume distinct in name.
    fn check(&self) -> Result<(), String> {
        let mut names: Vec<(&str, u64)> = self.volumes.iter().map(|v| (v.name.as_str(), v.id)).collect();
        let mut ids: Vec<u64> = names.iter().map(|(_, id)| *id).collect();
        // Snapshots listed or being taken: distinct by volume and name.
        let mut snapshots: Vec<&CatalogSnapshot> = self.snapshots.iter().collect();
        ids.extend(self.snapshots.iter().map(|s| s.id));
        for i in &self.intentions {
            ids.push(i.id);
            match &i.op {
                Intent::Create { name, .. } => names.push((name.as_str(), i.id)),
                Intent::Delete { volume_id, snapshots: deleted, .. } => {
                    ids.push(*volume_id);
                    ids.extend(deleted.iter().map(|s| s.id));
                    if let Some(s) = deleted.iter().find(|s| s.volume_id != *volume_id) {
                        return Err(format!("the catalog deletes snapshot {} with a volume it was not taken of", s.id));
                    }
                    check_snapshots(deleted)?;
                }
                Intent::SnapshotCreate { snapshot } => {
                    if snapshot.id != i.id {
                        return Err(format!("the catalog takes snapshot {} by intention {}", snapshot.id, i.id));
                    }
                    snapshots.push(snapshot);
                }
                Intent::SnapshotDelete { snapshot } => {
                    ids.push(snapshot.id);
                    check_snapshots(std::slice::from_ref(snapshot))?;
                }
                Intent::Resize { name, volume_id, from_bytes, size_bytes, storage_bytes } => {
                    let listed = self.volumes.iter().find(|v| v.id == *volume_id && &v.name == name);
                    let possible = listed
                        .is_some_and(|v| v.size_bytes == *from_bytes && v.storage_bytes <= *storage_bytes)
                        && from_bytes != size_bytes
                        && *storage_bytes == listed.map_or(0, |v| v.storage_bytes).max(*size_bytes);
                    if !possible {
                        return Err(format!("the catalog holds a resize of {name} (id {volume_id}) that cannot be"));
                    }
                    let others = self.intentions.iter().filter(|j| j.id != i.id && j.volume_id() == *volume_id);
                    if others.count() > 0 {
                        return Err(format!("the catalog holds a resize of {name} besides another operation on it"));
                    }
                }
            }
        }
        // A resize takes no volume of its own (at most one per volume: checked below).
        let taking = self.volumes.len() + self.intentions.iter().filter(|i| !i.is_resize() && !i.is_snapshot()).count();
        if taking > CATALOG_VOLUMES_MAX {
            return Err(format!("the catalog names {taking} volumes and intentions, more than {CATALOG_VOLUMES_MAX}"));
        }
        let owned: Vec<CatalogSnapshot> = snapshots.iter().map(|s| (*s).clone()).collect();
        check_snapshots(&owned)?;
        if snapshots.len() > CATALOG_SNAPSHOTS_MAX {
            return Err(format!("the catalog names {} snapshots, more than {CATALOG_SNAPSHOTS_MAX}", snapshots.len()));
        }
        for (k, s) in snapshots.iter().enumerate() {
            if snapshots[..k].iter().any(|t| t.volume_id == s.volume_id && t.volume == s.volume && t.name == s.name) {
                return Err(format!("the catalog names snapshot {} twice", s.export_name()));
            }
        }
        let volumes = self.intentions.iter().filter(|i| !i.is_snapshot()).map(Intention::volume);
        for v in self.volumes.iter().cloned().chain(volumes) {
            check_name(&v.name)?;
            check_size(v.size_bytes)?;
            check_size(v.storage_bytes)?;
            if v.storage_bytes < v.size_bytes {
                return Err(format!("the catalog stores volume {} in fewer bytes than it exports", v.name));
            }
            if let Some(w) = &v.member_of {
                let fits = w.offset_bytes.is_multiple_of(BLOCK_BYTES)
                    && w.offset_bytes.checked_add(v.size_bytes).is_some_and(|end| end <= v.storage_bytes);
                let named = [&w.group, &w.storage].iter().all(|n| !n.is_empty() && n.len() <= 255);
                if !fits || !named || v.clone_of.is_some() {
                    return Err(format!(
                        "the catalog places member {} of group {:?} where it cannot be",
                        v.name, w.group
                    ));
                }
            }
            if let Some(base) = &v.clone_of {
                check_snapshots(std::slice::from_ref(base))?;
                if base.size_bytes > v.storage_bytes {
                    return Err(format!(
                        "the catalog makes volume {} a clone of snapshot {}, which is larger than the volume",
                        v.name, base.id
                    ));
                }
            }
        }
        for (k, (name, id)) in names.iter().enumerate() {
            if names[..k].iter().any(|(n, i)| n == name || i == id) {
                return Err(format!("the catalog names {name} (or its id {id}) twice"));
            }
        }
        for (k, id) in ids.iter().enumerate() {
            if *id >= self.next_id {
                return Err(format!("the catalog uses id {id}, not below its next id"));
            }
            if ids[..k].contains(id) {
                return Err(format!("the catalog uses id {id} twice"));
            }
        }
        Ok(())
    }
}

/// `storage` grew to at least `bytes` (entries never shrink).
fn grow_entry(grown: &mut Vec<(String, u64)>, storage: &str, bytes: u64) {
    match grown.iter_mut().find(|(s, _)| s == storage) {
        Some(entry) => entry.1 = entry.1.max(bytes),
        None => grown.push((storage.to_string(), bytes)),
    }
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
}

fn put_snapshot(out: &mut Vec<u8>, s: &CatalogSnapshot) {
    out.extend_from_slice(&s.id.to_le_bytes());
    put_name(out, &s.volume);
    out.extend_from_slice(&s.volume_id.to_le_bytes());
    put_name(out, &s.name);
    out.extend_from_slice(&s.size_bytes.to_le_bytes());
    out.extend_from_slice(&s.taken_at.to_le_bytes());
}

fn put_origin(out: &mut Vec<u8>, clone_of: &Option<CatalogSnapshot>, member_of: &Option<GroupWindow>) {
    match (clone_of, member_of) {
        (Some(snapshot), _) => {
            out.push(1);
            put_snapshot(out, snapshot);
        }
        (None, Some(w)) => {
            out.push(2);
            put_name(out, &w.group);
            put_name(out, &w.storage);
            out.extend_from_slice(&w.offset_bytes.to_le_bytes());
        }
        (None, None) => out.push(0),
    }
}

fn put_snapshots(out: &mut Vec<u8>, snapshots: &[CatalogSnapshot]) {
    out.extend_from_slice(&(snapshots.len() as u32).to_le_bytes());
    for s in snapshots {
        put_snapshot(out, s);
    }
}

/// Whether `name` may name a snapshot: as a volume's name (see [`check_name`]).
pub fn check_snapshot_name(name: &str) -> Result<(), String> {
    check_name(name).map_err(|e| e.replacen("volume name", "snapshot name", 1))
}

/// Names and sizes of snapshots as listed.
fn check_snapshots(snapshots: &[CatalogSnapshot]) -> Result<(), String> {
    for s in snapshots {
        check_snapshot_name(&s.name)?;
        check_size(s.size_bytes)?;
        if s.volume.is_empty() || s.volume.len() > 255 {
            return Err(format!("the catalog holds snapshot {} of a volume named {:?}", s.id, s.volume));
        }
    }
    Ok(())
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.rest.len() < n {
            return Err("the catalog document is cut short".into());
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn count(&mut self) -> Result<usize, String> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize;
        if n > CATALOG_VOLUMES_MAX {
            return Err(format!("the catalog counts {n} entries, more than {CATALOG_VOLUMES_MAX}"));
        }
        Ok(n)
    }
    fn name(&mut self) -> Result<String, String> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "the catalog holds a name that is not UTF-8".to_string())
    }
    fn snapshot(&mut self) -> Result<CatalogSnapshot, String> {
        Ok(CatalogSnapshot {
            id: self.u64()?,
            volume: self.name()?,
            volume_id: self.u64()?,
            name: self.name()?,
            size_bytes: self.u64()?,
            taken_at: self.u64()?,
        })
    }
    fn origin(&mut self) -> Result<(Option<CatalogSnapshot>, Option<GroupWindow>), String> {
        match self.u8()? {
            0 => Ok((None, None)),
            1 => Ok((Some(self.snapshot()?), None)),
            2 => {
                Ok((None, Some(GroupWindow { group: self.name()?, storage: self.name()?, offset_bytes: self.u64()? })))
            }
            flag => Err(format!("the catalog holds a volume of unknown origin {flag}")),
        }
    }
    fn snapshots(&mut self) -> Result<Vec<CatalogSnapshot>, String> {
        let n = self.count()?;
        (0..n).map(|_| self.snapshot()).collect()
    }
}

/// When intentions are written (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogPolicy {
    None,
    Single,
    Group,
}

impl LogPolicy {
    pub fn parse(s: &str) -> Result<LogPolicy, String> {
        match s {
            "none" => Ok(LogPolicy::None),
            "single" => Ok(LogPolicy::Single),
            "group" => Ok(LogPolicy::Group),
            _ => Err(format!("unknown intention-log policy {s:?} (none, single or group)")),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            LogPolicy::None => "none",
            LogPolicy::Single => "single",
            LogPolicy::Group => "group",
        }
    }
}

/// One write of the catalog to make: the whole document, and the intentions it logs (to
/// execute once it is durable).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CatalogWrite {
    pub document: Vec<u8>,
    pub logs: Vec<Intention>,
}

/// The coordinator's intention log over the catalog: which operations wait to be logged,
/// which write is under way, which executed operations wait for their completion to be
/// written. One catalog write at a time, so they land in order.
#[derive(Debug)]
pub struct IntentionLog {
    catalog: Catalog,
    policy: LogPolicy,
    /// Asked for and not logged yet, with when they were asked.
    waiting: VecDeque<(Intention, Time)>,
    /// Executed (or undone), their outcome not written yet: (id, carried out?).
    finished: Vec<(u64, bool)>,
    finished_since: Option<Time>,
    /// The write under way: the intentions it logs.
    writing: Option<Vec<Intention>>,
    /// Outcomes (id, carried out?) in the catalog as written or being written, not known
    /// durable yet: a failed write leaves them to the next one.
    outcomes_unsure: Vec<(u64, bool)>,
    /// Outcomes a write made durable, for `take_durable`.
    outcomes_durable: Vec<(u64, bool)>,
    /// A write failed: write again even with nothing new, so that what it carried is known.
    rewrite: bool,
}

impl IntentionLog {
    pub fn new(catalog: Catalog, policy: LogPolicy) -> IntentionLog {
        IntentionLog {
            catalog,
            policy,
            waiting: VecDeque::new(),
            finished: Vec::new(),
            finished_since: None,
            writing: None,
            outcomes_unsure: Vec::new(),
            outcomes_durable: Vec::new(),
            rewrite: false,
        }
    }

    /// The catalog as the log sees it (what is written, and the write under way).
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub fn policy(&self) -> LogPolicy {
        self.policy
    }

    /// Whether `name` is taken here (created, intended, or waiting to be logged).
    pub fn has_name(&self, name: &str) -> bool {
        self.catalog.has_name(name)
            || self.waiting.iter().any(|(i, _)| matches!(&i.op, Intent::Create { name: n, .. } if n == name))
    }

    /// Ask to delete volume `name` (one created while running): its intention, once logged, or
    /// at once with policy `none`. The write that logs it drops the volume's entry, and those
    /// of its snapshots: a volume with snapshots is deleted only `with_snapshots`.
    pub fn intend_delete(&mut self, now: Time, name: &str, with_snapshots: bool) -> Result<Intention, String> {
        let volume = self.listed_volume(name, "delete")?;
        let count = self.catalog.volumes.len() + self.catalog.intentions.len() + self.waiting.len();
        if count >= CATALOG_VOLUMES_MAX {
            return Err(format!("{CATALOG_VOLUMES_MAX} volume operations are pending"));
        }
        let snapshots: Vec<CatalogSnapshot> =
            self.catalog.snapshots.iter().filter(|s| s.volume_id == volume.id).cloned().collect();
        if !snapshots.is_empty() && !with_snapshots {
            let names: Vec<&str> = snapshots.iter().map(|s| s.name.as_str()).collect();
            return Err(format!(
                "volume {name} has {} snapshot(s) ({}): delete them first, or pass --with-snapshots to delete them with it",
                snapshots.len(),
                names.join(", ")
            ));
        }
        let clones: Vec<String> = snapshots.iter().flat_map(|s| self.clones_of(s.id)).collect();
        if !clones.is_empty() {
            return Err(format!(
                "volume {name} has snapshots with clone(s) ({}): delete the clones first",
                clones.join(", ")
            ));
        }
        let op = Intent::Delete {
            name: name.to_string(),
            volume_id: volume.id,
            size_bytes: volume.size_bytes,
            storage_bytes: volume.storage_bytes,
            snapshots,
            clone_of: volume.clone_of.clone(),
            member_of: volume.member_of.clone(),
        };
        let intention = Intention { id: self.catalog.next_id, op };
        self.catalog.next_id += 1;
        self.waiting.push_back((intention.clone(), now));
        Ok(intention)
    }

    /// The listed volume `name` that an operation (`what`: "delete", "resize") may be asked
    /// for: none other is pending on it.
    fn listed_volume(&mut self, name: &str, what: &str) -> Result<CatalogVolume, String> {
        // A creation or resize carried out whose completion is not written yet (a group
        // commit's wait, or one rolled forward at start-up) is listed now: the next write says
        // so.
        self.list_finished(|i| !i.is_delete() && !i.is_snapshot() && i.volume().name == name);
        let Some(volume) = self.catalog.volumes.iter().find(|v| v.name == name).cloned() else {
            let creating = self
                .waiting
                .iter()
                .map(|(i, _)| i)
                .chain(&self.catalog.intentions)
                .any(|i| matches!(&i.op, Intent::Create { name: n, .. } if n == name));
            return Err(if creating {
                format!("volume {name} is being created; {what} it once its creation is answered")
            } else {
                format!("no volume {name} was created while running")
            });
        };
        let pending = self
            .waiting
            .iter()
            .map(|(i, _)| i)
            .chain(&self.catalog.intentions)
            .find(|i| !i.is_create() && i.volume_id() == volume.id);
        if let Some(other) = pending {
            let doing = match other.op {
                Intent::Delete { .. } => "deleted",
                Intent::SnapshotCreate { .. } => "snapshotted",
                Intent::SnapshotDelete { .. } => "rid of a snapshot",
                _ => "resized",
            };
            return Err(format!("volume {name} is being {doing}; {what} it once that is answered"));
        }
        Ok(volume)
    }

    /// Intentions carried out whose completions wait to be written (a group commit's wait)
    /// and that `which` picks: their outcomes go into the catalog now (the next write says
    /// so), so that what they did is listed.
    fn list_finished(&mut self, which: impl Fn(&Intention) -> bool) {
        let done: Vec<u64> = self
            .finished
            .iter()
            .filter(|(id, done)| *done && self.catalog.intentions.iter().any(|i| i.id == *id && which(i)))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            self.finished.retain(|(f, _)| *f != id);
            self.finish_in_catalog(id, true);
            self.outcomes_unsure.push((id, true));
        }
    }

    /// Pending intentions (waiting or logged), oldest first.
    fn pending(&self) -> impl Iterator<Item = &Intention> {
        self.catalog.intentions.iter().chain(self.waiting.iter().map(|(i, _)| i))
    }

    /// Ask to take snapshot `name` of the volume exported as `volume` (created while running
    /// with id `volume_id`, or configured: [`CONFIGURED_VOLUME_ID`]) of `size_bytes`: its
    /// intention, once logged.
    /// Refused with policy `none` (a snapshot taken and lost from the catalog by a crash would
    /// cost every element its blocks, unlisted), for a name its volume has already, and while
    /// the volume is being deleted or resized.
    pub fn intend_snapshot(
        &mut self,
        now: Time,
        volume: &str,
        volume_id: u64,
        name: &str,
        size_bytes: u64,
    ) -> Result<Intention, String> {
        if self.policy == LogPolicy::None {
            return Err("a snapshot must be logged: start the host element with --intention-log group or single".into());
        }
        check_snapshot_name(name)?;
        check_size(size_bytes)?;
        if volume_id != CONFIGURED_VOLUME_ID {
            self.list_finished(|i| !i.is_delete() && !i.is_snapshot() && i.volume().name == volume);
            if !self.catalog.volumes.iter().any(|v| v.id == volume_id && v.name == volume) {
                return Err(format!("no volume {volume} (see starfish volume list)"));
            }
        }
        let busy = self.pending().find(|i| {
            matches!(i.op, Intent::Delete { .. } | Intent::Resize { .. })
                && volume_id != CONFIGURED_VOLUME_ID
                && i.volume_id() == volume_id
        });
        if let Some(other) = busy {
            return Err(format!("volume {volume} is being {}d; snapshot it once that is answered", other.kind()));
        }
        let same = |s: &CatalogSnapshot| s.volume_id == volume_id && s.volume == volume && s.name == name;
        let taken = self.catalog.snapshots.iter().any(same)
            || self.pending().any(|i| matches!(&i.op, Intent::SnapshotCreate { snapshot } if same(snapshot)));
        if taken {
            return Err(format!("volume {volume} has a snapshot named {name}"));
        }
        let count = self.catalog.snapshots.len() + self.pending().filter(|i| i.is_snapshot()).count();
        if count >= CATALOG_SNAPSHOTS_MAX {
            return Err(format!("{CATALOG_SNAPSHOTS_MAX} snapshots exist or are being taken"));
        }
        let id = self.catalog.next_id;
        let snapshot = CatalogSnapshot {
            id,
            volume: volume.to_string(),
            volume_id,
            name: name.to_string(),
            size_bytes,
            taken_at: 0,
        };
        let intention = Intention { id, op: Intent::SnapshotCreate { snapshot } };
        self.catalog.next_id += 1;
        self.waiting.push_back((intention.clone(), now));
        Ok(intention)
    }

    /// Ask to delete snapshot `name` of the volume exported as `volume`: its intention, once
    /// logged. The write that logs it drops the snapshot's entry.
    pub fn intend_snapshot_delete(&mut self, now: Time, volume: &str, name: &str) -> Result<Intention, String> {
        if self.policy == LogPolicy::None {
            return Err(
                "a snapshot's deletion must be logged: start the host element with --intention-log group or single"
                    .into(),
            );
        }
        self.list_finished(|i| matches!(&i.op, Intent::SnapshotCreate { snapshot } if snapshot.volume == volume));
        let Some(snapshot) = self.catalog.snapshots.iter().find(|s| s.volume == volume && s.name == name).cloned()
        else {
            let taking = self.pending().any(
                |i| matches!(&i.op, Intent::SnapshotCreate { snapshot: s } if s.volume == volume && s.name == name),
            );
            return Err(if taking {
                format!("snapshot {volume}@{name} is being taken; delete it once that is answered")
            } else {
                format!("no snapshot {volume}@{name} (see starfish snapshot list)")
            });
        };
        let deleting = self.pending().any(|i| {
            matches!(&i.op, Intent::SnapshotDelete { snapshot: s } if s.id == snapshot.id)
                || matches!(&i.op, Intent::Delete { volume_id, .. } if *volume_id == snapshot.volume_id)
        });
        if deleting {
            return Err(format!("snapshot {volume}@{name} is being deleted"));
        }
        let clones = self.clones_of(snapshot.id);
        if !clones.is_empty() {
            return Err(format!("snapshot {volume}@{name} has clone(s) ({}): delete them first", clones.join(", ")));
        }
        let intention = Intention { id: self.catalog.next_id, op: Intent::SnapshotDelete { snapshot } };
        self.catalog.next_id += 1;
        self.waiting.push_back((intention.clone(), now));
        Ok(intention)
    }

    /// Snapshot intention `id` was carried out and is held from sequence `taken_at` on: listed
    /// so by its completion (see [`IntentionLog::finish`]).
    pub fn set_taken_at(&mut self, id: u64, taken_at: u64) {
        for i in self.catalog.intentions.iter_mut().filter(|i| i.id == id) {
            if let Intent::SnapshotCreate { snapshot } = &mut i.op {
                snapshot.taken_at = taken_at;
            }
        }
    }

    /// Ask to resize volume `name` (one created while running) to `size_bytes`: its
    /// intention, once logged. A smaller size needs `shrink` (and a larger one must not have
    /// it). Refused with policy `none` (see the module's documentation), for the size it has,
    /// and while another operation on the volume is pending.
    pub fn intend_resize(&mut self, now: Time, name: &str, size_bytes: u64, shrink: bool) -> Result<Intention, String> {
        if self.policy == LogPolicy::None {
            return Err("a resize must be logged: start the host element with --intention-log group or single".into());
        }
        check_size(size_bytes)?;
        let volume = self.listed_volume(name, "resize")?;
        if let Some(w) = &volume.member_of {
            return Err(member_resize_refusal(name, &w.group));
        }
        check_resize(name, volume.size_bytes, size_bytes, shrink)?;
        let op = Intent::Resize {
            name: name.to_string(),
            volume_id: volume.id,
            from_bytes: volume.size_bytes,
            size_bytes,
            storage_bytes: volume.storage_bytes.max(size_bytes),
        };
        let intention = Intention { id: self.catalog.next_id, op };
        self.catalog.next_id += 1;
        self.waiting.push_back((intention.clone(), now));
        Ok(intention)
    }

    /// Ask to create volume `name`: its intention, once logged (see [`IntentionLog::poll_write`]
    /// and [`IntentionLog::written`]), or at once with policy `none`
    /// ([`IntentionLog::take_unlogged`]).
    pub fn intend_create(&mut self, now: Time, name: &str, size_bytes: u64) -> Result<Intention, String> {
        self.intend_volume(now, name, size_bytes, None, None)
    }

    /// Ask to create volume `name` as a member of consistency group `group`, carried by storage
    /// volume `storage` whose members end at `members_end` now (its configured ones, and any
    /// that joined): a window of `size_bytes` at the next [`crate::groups::MEMBER_ALIGN_BYTES`]
    /// boundary past them and past [`Catalog::group_end`]. Its intention, once logged, names
    /// the window. Refused with policy `none` (a member lost from the catalog by a crash
    /// would leave its data in the group's storage volume, unlisted) and while another
    /// member joins the group or leaves it (each grows or zeroes the one storage volume).
    pub fn intend_join(
        &mut self,
        now: Time,
        name: &str,
        size_bytes: u64,
        group: &str,
        storage: &str,
        members_end: u64,
    ) -> Result<Intention, String> {
        if self.policy == LogPolicy::None {
            return Err(
                "joining a consistency group must be logged: start the host element with --intention-log group or single"
                    .into(),
            );
        }
        // Carried out, its completion waiting for the next write: done already.
        let done = |i: &Intention| self.finished.iter().any(|(id, _)| *id == i.id);
        let busy = self.pending().find(|i| {
            (i.is_create() || i.is_delete()) && !done(i) && i.volume().member_of.is_some_and(|w| w.storage == storage)
        });
        if let Some(other) = busy {
            return Err(format!(
                "volume {} is joining or leaving consistency group {group}; ask again once that is answered",
                other.volume().name
            ));
        }
        // A deletion carried out frees its window at once: the write that logs this join
        // completes that deletion too (every write carries the completions due).
        let deleted = |id: u64| self.finished.iter().any(|&(f, done)| f == id && done);
        let window = self.catalog.join_window(group, storage, members_end, size_bytes, deleted);
        let Some((offset_bytes, storage_bytes)) = window else {
            return Err(group_too_large(group));
        };
        let window = GroupWindow { group: group.to_string(), storage: storage.to_string(), offset_bytes };
        self.intend_volume(now, name, size_bytes, None, Some((window, storage_bytes)))
    }

    /// Ask to create volume `name` as a clone of the snapshot exported as `snapshot`
    /// (`VOLUME@NAME`), of its size: its intention, once logged. Refused with policy `none`
    /// (a clone lost from the catalog by a crash would keep its snapshot's blocks on every
    /// element, unlisted), for a snapshot not listed (or still being taken), and for a
    /// snapshot being deleted.
    pub fn intend_clone(&mut self, now: Time, snapshot: &str, name: &str) -> Result<Intention, String> {
        if self.policy == LogPolicy::None {
            return Err("a clone must be logged: start the host element with --intention-log group or single".into());
        }
        let base = self.listed_snapshot(snapshot)?;
        let deleting = self.pending().any(|i| {
            matches!(&i.op, Intent::SnapshotDelete { snapshot: s } if s.id == base.id)
                || matches!(&i.op, Intent::Delete { volume_id, .. } if *volume_id == base.volume_id && base.volume_id != CONFIGURED_VOLUME_ID)
        });
        if deleting {
            return Err(format!("snapshot {snapshot} is being deleted"));
        }
        let size_bytes = base.size_bytes;
        self.intend_volume(now, name, size_bytes, Some(base), None)
    }

    /// The snapshot exported as `snapshot` (`VOLUME@NAME`), taken and listed (one whose
    /// completion waits for the next write is listed now).
    pub fn listed_snapshot(&mut self, snapshot: &str) -> Result<CatalogSnapshot, String> {
        let Some((volume, snapshot_name)) = snapshot.rsplit_once('@') else {
            return Err(format!("{snapshot:?} names no snapshot: clone VOLUME@SNAPSHOT (see starfish snapshot list)"));
        };
        self.list_finished(|i| matches!(&i.op, Intent::SnapshotCreate { snapshot } if snapshot.volume == volume));
        let found = self.catalog.snapshots.iter().find(|s| s.volume == volume && s.name == snapshot_name).cloned();
        found.ok_or_else(|| {
            let taking = self.pending().any(|i| {
                matches!(&i.op, Intent::SnapshotCreate { snapshot: s } if s.volume == volume && s.name == snapshot_name)
            });
            if taking {
                format!("snapshot {snapshot} is being taken; clone it once that is answered")
            } else {
                format!("no snapshot {snapshot} (see starfish snapshot list)")
            }
        })
    }

    /// Ask to create volume `name` as a clone of snapshot `base`, as [`IntentionLog::intend_clone`]
    /// does once it found it listed (the simulator's hosts take snapshots of configured
    /// volumes through the core, which the catalog does not list).
    pub fn intend_clone_of(&mut self, now: Time, name: &str, base: CatalogSnapshot) -> Result<Intention, String> {
        let size_bytes = base.size_bytes;
        self.intend_volume(now, name, size_bytes, Some(base), None)
    }

    /// The volumes (by name) created, or being created, as clones of snapshot `id`.
    pub fn clones_of(&self, id: u64) -> Vec<String> {
        let listed = self.catalog.volumes.iter().filter(|v| v.clone_of.as_ref().is_some_and(|s| s.id == id));
        let pending = self.pending().filter_map(|i| match &i.op {
            Intent::Create { name, clone_of: Some(s), .. } if s.id == id => Some(name.clone()),
            _ => None,
        });
        listed.map(|v| v.name.clone()).chain(pending).collect()
    }

    fn intend_volume(
        &mut self,
        now: Time,
        name: &str,
        size_bytes: u64,
        clone_of: Option<CatalogSnapshot>,
        joining: Option<(GroupWindow, u64)>,
    ) -> Result<Intention, String> {
        check_name(name)?;
        check_size(size_bytes)?;
        if self.has_name(name) {
            return Err(format!("a volume named {name} exists"));
        }
        let count = self.catalog.volumes.len() + self.catalog.intentions.len() + self.waiting.len();
        if count >= CATALOG_VOLUMES_MAX {
            return Err(format!("{CATALOG_VOLUMES_MAX} volumes were created already"));
        }
        let (member_of, storage_bytes) = match joining {
            Some((window, storage_bytes)) => (Some(window), storage_bytes),
            None => (None, size_bytes),
        };
        let op = Intent::Create { name: name.to_string(), size_bytes, clone_of, member_of, storage_bytes };
        let intention = Intention { id: self.catalog.next_id, op };
        self.catalog.next_id += 1;
        self.waiting.push_back((intention.clone(), now));
        Ok(intention)
    }

    /// Policy `none`: the intentions to execute at once, unlogged.
    pub fn take_unlogged(&mut self) -> Vec<Intention> {
        if self.policy != LogPolicy::None {
            return Vec::new();
        }
        let taken: Vec<Intention> = self.waiting.drain(..).map(|(i, _)| i).collect();
        for i in &taken {
            // Listed as gone by the next write (the completion's).
            self.catalog.drop_listed(i);
        }
        taken
    }

    /// The write to make now, if one is due and none is under way.
    pub fn poll_write(&mut self, now: Time) -> Option<CatalogWrite> {
        if self.writing.is_some() {
            return None;
        }
        let take = match self.policy {
            LogPolicy::None => 0,
            LogPolicy::Single => self.waiting.len().min(1),
            LogPolicy::Group => {
                let oldest = self.waiting.front().map(|(_, at)| *at);
                let due =
                    self.waiting.len() >= GROUP_BATCH || oldest.is_some_and(|at| now.0 >= at.0 + GROUP_WAIT_MS * 1000);
                if due {
                    self.waiting.len()
                } else {
                    0
                }
            }
        };
        let finish_due = !self.finished.is_empty()
            && (self.policy != LogPolicy::Group
                || self.finished_since.is_some_and(|at| now.0 >= at.0 + GROUP_WAIT_MS * 1000));
        if take == 0 && !finish_due && !self.rewrite {
            return None;
        }
        self.rewrite = false;
        let logs: Vec<Intention> = self.waiting.drain(..take).map(|(i, _)| i).collect();
        for (id, done) in std::mem::take(&mut self.finished) {
            self.finish_in_catalog(id, done);
            self.outcomes_unsure.push((id, done));
        }
        self.finished_since = None;
        for i in &logs {
            self.catalog.drop_listed(i);
        }
        self.catalog.intentions.extend(logs.iter().cloned());
        self.catalog.version += 1;
        self.writing = Some(logs.clone());
        Some(CatalogWrite { document: self.catalog.encode(), logs })
    }

    /// Intention `id` leaves the catalog, listing what it leaves (`Catalog::list_outcome`).
    fn finish_in_catalog(&mut self, id: u64, done: bool) {
        if let Some(k) = self.catalog.intentions.iter().position(|i| i.id == id) {
            let intention = self.catalog.intentions.remove(k);
            self.catalog.list_outcome(&intention, done);
        }
    }

    /// The write under way is durable on Q elements: the intentions it logged, to execute.
    /// The outcomes it (or a failed write before it) carried are durable too: see
    /// [`IntentionLog::take_durable`].
    pub fn written(&mut self) -> Vec<Intention> {
        self.outcomes_durable.append(&mut self.outcomes_unsure);
        self.writing.take().unwrap_or_default()
    }

    /// The write under way failed (the catalog volume lost its quorum): it may or may not be
    /// on the elements, so its intentions are undone by the next write, which is made even
    /// if nothing else is due. Only once that write is durable ([`IntentionLog::take_durable`]
    /// says `(id, false)`) is an undone operation known not to happen: a host element that
    /// starts before may find the intention and carry it out.
    pub fn write_failed(&mut self) -> Vec<Intention> {
        let logs = self.writing.take().unwrap_or_default();
        for i in &logs {
            self.finish(Time(0), i.id, false);
        }
        self.rewrite = true;
        logs
    }

    /// Outcomes made durable since the last call: (intention id, carried out?).
    pub fn take_durable(&mut self) -> Vec<(u64, bool)> {
        std::mem::take(&mut self.outcomes_durable)
    }

    /// Intention `id` was carried out (`done`) or undone: written with the next write.
    pub fn finish(&mut self, now: Time, id: u64, done: bool) {
        if self.finished_since.is_none() {
            self.finished_since = Some(now);
        }
        self.finished.push((id, done));
    }

    /// Policy `none`: volume `volume` (never logged) was created; list it with the next write.
    pub fn finish_unlogged(&mut self, now: Time, volume: CatalogVolume) {
        self.catalog.volumes.push(volume.clone());
        self.finish(now, volume.id, true);
    }

    /// When [`IntentionLog::poll_write`] should be called again (group commit's wait).
    pub fn deadline(&self) -> Option<Time> {
        if self.writing.is_some() || self.policy != LogPolicy::Group {
            return None;
        }
        let wait = GROUP_WAIT_MS * 1000;
        let intents = self.waiting.front().map(|(_, at)| Time(at.0 + wait));
        let finished = self.finished_since.map(|at| Time(at.0 + wait));
        intents.into_iter().chain(finished).min()
    }

    /// Nothing waits and nothing is being written.
    pub fn idle(&self) -> bool {
        self.writing.is_none() && self.waiting.is_empty() && self.finished.is_empty() && !self.rewrite
    }
}

#[cfg(test)]
mod tests;
