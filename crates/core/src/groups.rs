//! Consistency groups (SMFS's group mirroring): the volumes of a group share one sequence
//! space, so every element applies their writes in one order and any element's copy of the
//! whole group is the result of a prefix of that order (crash-consistent as a whole).
//!
//! A group is carried as one storage volume, `NAME[A,B,…]` (the group's name and its volumes'
//! names, sorted), holding its member volumes one after another in that order, each at a 1 MiB
//! boundary. The name records the layout: a group whose membership changes is a new storage
//! volume (the old one stays on the elements, untouched), never old data under other names. Everything that works per volume — sequencing,
//! the write queue, recovery of every kind, scrub, the elements' logs and fencing — thereby
//! works per group, with no rule of its own. The host element exports each member as its own
//! NBD volume: a window of the group's storage volume. A volume in no group is its own
//! storage volume, exported whole, as before groups existed.

use proto::VolumeSpec;

/// Member volumes of a group start at multiples of this.
pub const MEMBER_ALIGN_BYTES: u64 = 1 << 20;

/// A consistency group as configured: its name and its volumes, in layout order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub name: String,
    pub volumes: Vec<String>,
}

/// A volume as the host element exports it: `size_bytes` at `offset_bytes` of storage
/// volume `volume` (the index in `HostConfig::volumes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedVolume {
    pub name: String,
    /// The consistency group it belongs to; `None`: its own.
    pub group: Option<String>,
    pub volume: usize,
    pub offset_bytes: u64,
    pub size_bytes: u64,
    /// A read-only export of this snapshot of the storage volume (`VOLUME@NAME`), not of
    /// the storage volume itself.
    pub snapshot: Option<proto::SnapshotRef>,
}

/// A volume that joined a consistency group while running (`starfish volume create NAME SIZE
/// --group G`, listed in the catalog): exported as `name`, `size_bytes` at `offset_bytes` of
/// the group's storage volume `storage`, which grows to hold it. The group's configured layout
/// stays as it is; joined members come after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinedMember {
    pub name: String,
    pub group: String,
    pub storage: String,
    pub offset_bytes: u64,
    pub size_bytes: u64,
}

/// Exports of volumes that are their own groups: each the whole of its storage volume.
pub fn ungrouped(volumes: &[VolumeSpec]) -> Vec<ExportedVolume> {
    volumes
        .iter()
        .enumerate()
        .map(|(i, v)| ExportedVolume {
            name: v.name.clone(),
            group: None,
            volume: i,
            offset_bytes: 0,
            size_bytes: v.size_bytes,
            snapshot: None,
        })
        .collect()
}

/// The storage volumes and exports of `volumes` arranged in `groups`. Storage volumes come in
/// the order the volumes are declared (a group where its first member is); the exports keep
/// the volumes' order. Errors name the problem for the operator.
pub fn layout(volumes: &[VolumeSpec], groups: &[GroupSpec]) -> Result<(Vec<VolumeSpec>, Vec<ExportedVolume>), String> {
    for (i, g) in groups.iter().enumerate() {
        if g.name.is_empty() || g.name.len() > 255 {
            return Err(format!("group name {:?} must be 1 to 255 bytes", g.name));
        }
        if groups[..i].iter().any(|h| h.name == g.name) {
            return Err(format!("group {} is configured twice", g.name));
        }
        if volumes.iter().any(|v| v.name == g.name) {
            return Err(format!("group {} has the name of a volume; give it another", g.name));
        }
        if g.volumes.is_empty() {
            return Err(format!("group {} names no volume", g.name));
        }
        for (j, name) in g.volumes.iter().enumerate() {
            if !volumes.iter().any(|v| &v.name == name) {
                return Err(format!("group {} names volume {name}, which is not configured", g.name));
            }
            if g.volumes[..j].contains(name) || groups[..i].iter().any(|h| h.volumes.contains(name)) {
                return Err(format!("volume {name} is named twice in groups (a volume is in one group at most)"));
            }
        }
    }
    let group_of = |volume: &str| groups.iter().find(|g| g.volumes.iter().any(|v| v == volume));
    let mut storage: Vec<VolumeSpec> = Vec::new();
    let mut placed: Vec<(String, usize, u64)> = Vec::new();
    for v in volumes {
        match group_of(&v.name) {
            None => {
                placed.push((v.name.clone(), storage.len(), 0));
                storage.push(v.clone());
            }
            Some(g) if placed.iter().any(|(n, _, _)| g.volumes.contains(n)) => {}
            Some(g) => {
                let mut members = g.volumes.clone();
                members.sort();
                let storage_name = format!("{}[{}]", g.name, members.join(","));
                if storage_name.len() > 255 {
                    return Err(format!(
                        "group {}: its name and its volumes' names come to more than 255 bytes together",
                        g.name
                    ));
                }
                let mut offset = 0u64;
                for member in &members {
                    let size = volumes.iter().find(|w| &w.name == member).expect("checked above").size_bytes;
                    placed.push((member.clone(), storage.len(), offset));
                    offset = offset
                        .checked_add(size.div_ceil(MEMBER_ALIGN_BYTES) * MEMBER_ALIGN_BYTES)
                        .ok_or_else(|| format!("group {} is too large", g.name))?;
                }
                // The last member ends the group (no padding after it).
                let last = volumes.iter().find(|w| Some(&w.name) == members.last()).expect("checked above");
                let end = placed.last().expect("a member").2 + last.size_bytes;
                // It grows as volumes join the group while running (see `JoinedMember`).
                storage.push(VolumeSpec { name: storage_name, size_bytes: end, clone_of: None, at_least: true });
            }
        }
    }
    let exports = volumes
        .iter()
        .map(|v| {
            let (_, volume, offset_bytes) = placed.iter().find(|(n, _, _)| n == &v.name).expect("every volume placed");
            ExportedVolume {
                name: v.name.clone(),
                group: group_of(&v.name).map(|g| g.name.clone()),
                volume: *volume,
                offset_bytes: *offset_bytes,
                size_bytes: v.size_bytes,
                snapshot: None,
            }
        })
        .collect();
    Ok((storage, exports))
}

/// Exports must lie inside their storage volumes, never overlap, and have distinct names.
pub fn check_exports(volumes: &[VolumeSpec], exports: &[ExportedVolume]) -> Result<(), String> {
    for (i, e) in exports.iter().enumerate() {
        let Some(v) = volumes.get(e.volume) else {
            return Err(format!("volume {} lies in storage volume {}, which does not exist", e.name, e.volume));
        };
        if e.size_bytes == 0 || e.offset_bytes.checked_add(e.size_bytes).is_none_or(|end| end > v.size_bytes) {
            return Err(format!("volume {} does not fit in {}", e.name, v.name));
        }
        if e.offset_bytes % proto::BLOCK_BYTES != 0 {
            return Err(format!("volume {} starts inside a block of {}", e.name, v.name));
        }
        for f in &exports[..i] {
            if f.name == e.name {
                return Err(format!("volume {} is exported twice", e.name));
            }
            // A snapshot's export reads another image of the same blocks.
            if f.volume == e.volume
                && e.snapshot.is_none()
                && f.snapshot.is_none()
                && e.offset_bytes < f.offset_bytes + f.size_bytes
                && f.offset_bytes < e.offset_bytes + e.size_bytes
            {
                return Err(format!("volumes {} and {} overlap", f.name, e.name));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, size_bytes: u64) -> VolumeSpec {
        VolumeSpec { name: name.into(), size_bytes, clone_of: None, at_least: false }
    }

    #[test]
    fn a_group_is_one_storage_volume_with_its_members_at_aligned_offsets() {
        let volumes = [spec("a", 3 << 20), spec("lone", 1 << 20), spec("b", (1 << 20) + 4096), spec("c", 8192)];
        let groups = [GroupSpec { name: "g".into(), volumes: vec!["b".into(), "a".into(), "c".into()] }];
        let (storage, exports) = layout(&volumes, &groups).expect("valid");
        // In name order: a at 0 (3 MiB slot), b at 3 MiB (2 MiB slot), c at 5 MiB: 5 MiB + 8 KiB.
        let group = VolumeSpec { at_least: true, ..spec("g[a,b,c]", (5 << 20) + 8192) };
        assert_eq!(storage, vec![group, spec("lone", 1 << 20)]);
        let at: Vec<(&str, usize, u64)> = exports.iter().map(|e| (e.name.as_str(), e.volume, e.offset_bytes)).collect();
        assert_eq!(at, vec![("a", 0, 0), ("lone", 1, 0), ("b", 0, 3 << 20), ("c", 0, 5 << 20)]);
        // The order the group names its volumes in does not move them.
        let reordered = [GroupSpec { name: "g".into(), volumes: vec!["c".into(), "a".into(), "b".into()] }];
        assert_eq!(layout(&volumes, &reordered).expect("valid"), (storage.clone(), exports.clone()));
        // Another membership is another storage volume, never the old data under a new name.
        let fewer = [GroupSpec { name: "g".into(), volumes: vec!["a".into(), "b".into()] }];
        assert_eq!(layout(&volumes, &fewer).expect("valid").0[0].name, "g[a,b]");
        assert_eq!(exports[1].group, None);
        assert_eq!(exports[0].group.as_deref(), Some("g"));
        check_exports(&storage, &exports).expect("consistent");
        // Without groups: the identity.
        let (storage, exports) = layout(&volumes, &[]).expect("valid");
        assert_eq!(storage, volumes.to_vec());
        assert_eq!(exports, ungrouped(&volumes));
    }

    #[test]
    fn bad_groups_are_refused_with_the_reason() {
        let volumes = [spec("a", 1 << 20), spec("b", 1 << 20)];
        let g = |name: &str, members: &[&str]| GroupSpec {
            name: name.into(),
            volumes: members.iter().map(|s| s.to_string()).collect(),
        };
        for (groups, says) in [
            (vec![g("g", &["a", "x"])], "not configured"),
            (vec![g("g", &["a", "a"])], "named twice"),
            (vec![g("g", &["a"]), g("h", &["a", "b"])], "named twice"),
            (vec![g("g", &["a"]), g("g", &["b"])], "configured twice"),
            (vec![g("a", &["b"])], "name of a volume"),
            (vec![g("g", &[])], "names no volume"),
            (vec![g("", &["a"])], "1 to 255 bytes"),
            (vec![g(&"x".repeat(251), &["a", "b"])], "more than 255 bytes"),
        ] {
            let error = layout(&volumes, &groups).expect_err(says);
            assert!(error.contains(says), "{error}");
        }
        let overlapping = vec![
            ExportedVolume {
                name: "a".into(),
                group: None,
                volume: 0,
                offset_bytes: 0,
                size_bytes: 8192,
                snapshot: None,
            },
            ExportedVolume {
                name: "b".into(),
                group: None,
                volume: 0,
                offset_bytes: 4096,
                size_bytes: 4096,
                snapshot: None,
            },
        ];
        assert!(check_exports(&[spec("s", 1 << 20)], &overlapping).expect_err("overlap").contains("overlap"));
    }
}
