//! Descriptor math: where a block lives inside a registered region, bounds
//! checks, and coalescing of byte-adjacent blocks into one operation.
//!
//! A *region* is a caller-owned span of memory registered with the engine
//! (one per KV cache layer, typically). It holds `block_count` blocks of
//! `block_len` bytes each; block `i` starts at `base + i * block_stride`
//! (`block_stride >= block_len`, equal for a densely packed region).

use crate::error::{PdgateError, Result};

/// Memory kind of a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemType {
    /// Ordinary host memory.
    Host,
    /// CUDA device memory (needs a CUDA-enabled UCX and a GPU).
    Cuda,
}

impl MemType {
    /// Wire code (stable).
    pub fn code(self) -> u8 {
        match self {
            MemType::Host => 0,
            MemType::Cuda => 1,
        }
    }
    /// Parse a wire code.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(MemType::Host),
            1 => Some(MemType::Cuda),
            _ => None,
        }
    }
    /// Parse `"host"` / `"cuda"` (also `"cpu"`).
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(MemType::Host),
            "cuda" | "gpu" => Ok(MemType::Cuda),
            other => Err(PdgateError::InvalidArgument(format!(
                "unknown memory type {other:?}"
            ))),
        }
    }
}

/// Geometry of one registered region (all sizes in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionLayout {
    /// Address of block 0.
    pub base: u64,
    /// Registered length.
    pub len: u64,
    /// Bytes moved per block.
    pub block_len: u64,
    /// Distance between the starts of consecutive blocks.
    pub block_stride: u64,
    /// Number of blocks.
    pub block_count: u64,
    /// Memory kind.
    pub mem_type: MemType,
}

impl RegionLayout {
    /// Build a layout from base/len/block geometry; `block_stride == 0` means
    /// `block_len`; `block_count == 0` means as many whole blocks as fit.
    pub fn new(
        base: u64,
        len: u64,
        block_len: u64,
        block_stride: u64,
        block_count: u64,
        mem_type: MemType,
    ) -> Result<Self> {
        let stride = if block_stride == 0 {
            block_len
        } else {
            block_stride
        };
        let count = if block_count == 0 && block_len > 0 && len >= block_len {
            (len - block_len) / stride + 1
        } else {
            block_count
        };
        let r = RegionLayout {
            base,
            len,
            block_len,
            block_stride: stride,
            block_count: count,
            mem_type,
        };
        r.validate()?;
        Ok(r)
    }

    /// Check internal consistency: non-empty blocks, stride >= block length,
    /// every block inside `[base, base+len)`, no address overflow.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(PdgateError::InvalidArgument(m));
        if self.block_len == 0 || self.block_count == 0 {
            return bad(format!(
                "empty region: block_len={} block_count={}",
                self.block_len, self.block_count
            ));
        }
        if self.block_stride < self.block_len {
            return bad(format!(
                "block_stride {} < block_len {}",
                self.block_stride, self.block_len
            ));
        }
        let end = (self.block_count - 1)
            .checked_mul(self.block_stride)
            .and_then(|x| x.checked_add(self.block_len));
        match end {
            Some(e) if e <= self.len => {}
            _ => {
                return bad(format!(
                    "{} blocks of {} bytes at stride {} overrun region of {} bytes",
                    self.block_count, self.block_len, self.block_stride, self.len
                ))
            }
        }
        if self.base.checked_add(self.len).is_none() {
            return bad("region wraps the address space".into());
        }
        Ok(())
    }

    /// Byte offset of block `id` from `base`, bounds-checked.
    pub fn block_offset(&self, id: u64) -> Result<u64> {
        if id >= self.block_count {
            return Err(PdgateError::OutOfRange(format!(
                "block {id} not in region of {} blocks",
                self.block_count
            )));
        }
        Ok(id * self.block_stride)
    }
}

/// One contiguous copy: `len` bytes between `local_off` and `remote_off`
/// (offsets from the respective region bases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub local_off: u64,
    pub remote_off: u64,
    pub len: u64,
}

/// Turn paired block id lists into coalesced segments.
///
/// Pairs are sorted by local block id, then consecutive pairs whose local
/// *and* remote bytes are adjacent merge into one segment. Every id is
/// bounds-checked first (`OutOfRange`); mismatched list lengths, unequal
/// block lengths, or a local block listed twice are `InvalidArgument`
/// (`dest_is_local` says which side is written and must be unique).
pub fn plan_segments(
    local: &RegionLayout,
    remote: &RegionLayout,
    local_ids: &[u64],
    remote_ids: &[u64],
    dest_is_local: bool,
) -> Result<Vec<Segment>> {
    if local_ids.len() != remote_ids.len() {
        return Err(PdgateError::InvalidArgument(format!(
            "{} local blocks vs {} remote blocks",
            local_ids.len(),
            remote_ids.len()
        )));
    }
    if local.block_len != remote.block_len {
        return Err(PdgateError::InvalidArgument(format!(
            "block length differs: local {} vs remote {} bytes",
            local.block_len, remote.block_len
        )));
    }
    let mut pairs = Vec::with_capacity(local_ids.len());
    for (&l, &r) in local_ids.iter().zip(remote_ids) {
        let lo = local.block_offset(l).map_err(|e| side("local", e))?;
        let ro = remote.block_offset(r).map_err(|e| side("remote", e))?;
        pairs.push((lo, ro));
    }
    if dest_is_local {
        pairs.sort_unstable();
    } else {
        pairs.sort_unstable_by_key(|&(l, r)| (r, l));
    }
    let bl = local.block_len;
    let mut out: Vec<Segment> = Vec::new();
    for (i, &(lo, ro)) in pairs.iter().enumerate() {
        if i > 0 {
            let prev = pairs[i - 1];
            if (dest_is_local && prev.0 == lo) || (!dest_is_local && prev.1 == ro) {
                return Err(PdgateError::InvalidArgument(
                    "a destination block is listed twice".into(),
                ));
            }
        }
        if let Some(last) = out.last_mut() {
            if last.local_off + last.len == lo && last.remote_off + last.len == ro {
                last.len += bl;
                continue;
            }
        }
        out.push(Segment {
            local_off: lo,
            remote_off: ro,
            len: bl,
        });
    }
    Ok(out)
}

fn side(which: &str, e: PdgateError) -> PdgateError {
    match e {
        PdgateError::OutOfRange(m) => PdgateError::OutOfRange(format!("{which} {m}")),
        other => other,
    }
}

/// Total bytes in a plan.
pub fn plan_bytes(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| s.len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dense(n: u64, bl: u64) -> RegionLayout {
        RegionLayout::new(0x1000, n * bl, bl, 0, n, MemType::Host).unwrap()
    }

    #[test]
    fn offsets_follow_stride() {
        let r = RegionLayout::new(0, 1000, 10, 100, 0, MemType::Host).unwrap();
        assert_eq!(r.block_count, 10);
        assert_eq!(r.block_offset(3).unwrap(), 300);
        assert!(matches!(
            r.block_offset(10),
            Err(PdgateError::OutOfRange(_))
        ));
    }

    #[test]
    fn rejects_bad_geometry() {
        assert!(RegionLayout::new(0, 100, 0, 0, 1, MemType::Host).is_err());
        assert!(RegionLayout::new(0, 100, 20, 10, 2, MemType::Host).is_err());
        assert!(RegionLayout::new(0, 100, 10, 10, 11, MemType::Host).is_err());
        assert!(RegionLayout::new(u64::MAX - 5, 100, 10, 10, 10, MemType::Host).is_err());
        assert!(RegionLayout::new(0, 100, 10, u64::MAX, 3, MemType::Host).is_err());
    }

    #[test]
    fn coalesces_runs() {
        let r = dense(100, 16);
        let s = plan_segments(&r, &r, &[5, 6, 7, 20, 9], &[1, 2, 3, 50, 4], true).unwrap();
        assert_eq!(
            s,
            vec![
                Segment {
                    local_off: 80,
                    remote_off: 16,
                    len: 48
                },
                Segment {
                    local_off: 144,
                    remote_off: 64,
                    len: 16
                },
                Segment {
                    local_off: 320,
                    remote_off: 800,
                    len: 16
                },
            ]
        );
    }

    #[test]
    fn strided_blocks_do_not_merge() {
        let r = RegionLayout::new(0, 1000, 10, 20, 0, MemType::Host).unwrap();
        let s = plan_segments(&r, &r, &[0, 1, 2], &[0, 1, 2], true).unwrap();
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn errors() {
        let r = dense(10, 8);
        assert!(
            matches!(plan_segments(&r, &r, &[1], &[10], true), Err(PdgateError::OutOfRange(m)) if m.starts_with("remote"))
        );
        assert!(
            matches!(plan_segments(&r, &r, &[10], &[1], true), Err(PdgateError::OutOfRange(m)) if m.starts_with("local"))
        );
        assert!(matches!(
            plan_segments(&r, &r, &[1, 2], &[1], true),
            Err(PdgateError::InvalidArgument(_))
        ));
        assert!(matches!(
            plan_segments(&r, &r, &[1, 1], &[1, 2], true),
            Err(PdgateError::InvalidArgument(_))
        ));
        assert!(plan_segments(&r, &r, &[1, 1], &[1, 2], false).is_ok());
        assert!(matches!(
            plan_segments(&r, &r, &[1, 2], &[3, 3], false),
            Err(PdgateError::InvalidArgument(_))
        ));
        let other = dense(10, 16);
        assert!(matches!(
            plan_segments(&r, &other, &[1], &[1], true),
            Err(PdgateError::InvalidArgument(_))
        ));
    }

    proptest! {
        /// The plan covers exactly the requested (local, remote) block pairs:
        /// expanding segments back to blocks gives the same set, byte count
        /// matches, and no two consecutive segments could have merged.
        #[test]
        fn plan_is_exact_and_maximal(
            n in 1u64..200, bl in 1u64..64, extra in 0u64..3, seed in proptest::collection::vec((0u64..200, 0u64..200), 0..120),
        ) {
            let stride = bl + extra;
            let local = RegionLayout::new(0, n * stride, bl, stride, n, MemType::Host).unwrap();
            let remote = RegionLayout::new(7, n * stride + 5, bl, stride, n, MemType::Host).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            let pairs: Vec<(u64, u64)> = seed.into_iter().map(|(a, b)| (a % n, b % n)).filter(|p| seen.insert(p.0)).collect();
            let l: Vec<u64> = pairs.iter().map(|p| p.0).collect();
            let r: Vec<u64> = pairs.iter().map(|p| p.1).collect();
            let segs = plan_segments(&local, &remote, &l, &r, true).unwrap();
            prop_assert_eq!(plan_bytes(&segs), bl * l.len() as u64);
            let mut got = Vec::new();
            for s in &segs {
                prop_assert!(s.len % bl == 0);
                if s.len > bl { prop_assert_eq!(stride, bl); }
                for k in 0..s.len / bl {
                    got.push(((s.local_off + k * bl) / stride, (s.remote_off + k * bl) / stride));
                }
            }
            let mut want = pairs.clone();
            want.sort();
            got.sort();
            prop_assert_eq!(got, want);
            for w in segs.windows(2) {
                prop_assert!(!(w[0].local_off + w[0].len == w[1].local_off && w[0].remote_off + w[0].len == w[1].remote_off));
            }
        }

        /// Any id >= block_count is rejected, any id below is accepted.
        #[test]
        fn bounds(n in 1u64..1000, id in 0u64..2000) {
            let r = dense(n, 4);
            prop_assert_eq!(r.block_offset(id).is_ok(), id < n);
            let res = plan_segments(&r, &r, &[0], &[id], true);
            prop_assert_eq!(res.is_ok(), id < n);
        }
    }
}
