//! Property-based fuzzing of the untrusted-input paths (issue 7): the peer
//! metadata decoder gets arbitrary and structure-aware mutated bytes (with the
//! length and CRC fields re-patched, so mutations reach the deep checks), and
//! the block math gets arbitrary geometry and block ids. Every input must end
//! in `Ok` or an error, never a panic (a panic would cross into Python).

use super::layout::{plan_bytes, plan_segments, MemType, RegionLayout};
use super::meta::{crc32, sample_meta, PeerMeta};
use crate::error::PdgateError;
use proptest::prelude::*;

/// Re-patch the total-length field and the trailing CRC so the decoder
/// passes its framing checks and validates the (mutated) contents.
fn reframe(mut body: Vec<u8>) -> Vec<u8> {
    if body.len() < 16 {
        return body;
    }
    let total = (body.len() + 4) as u32;
    body[12..16].copy_from_slice(&total.to_le_bytes());
    let c = crc32(&body);
    body.extend_from_slice(&c.to_le_bytes());
    body
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Overwrite 8 bytes with an extreme little-endian value.
    Word(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..32).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), prop_oneof![Just(0u64), Just(u64::MAX), Just(u32::MAX as u64), Just(1u64 << 63), any::<u64>()])
            .prop_map(|(i, w)| Mutation::Word(i, w)),
    ]
}

fn apply(body: &mut Vec<u8>, m: &Mutation) {
    // Byte 0..16 is the header (magic, version, flags, length): mutate after it
    // so the mutation reaches the payload checks (the header has its own tests).
    if body.len() <= 16 {
        return;
    }
    let span = body.len() - 16;
    match m {
        Mutation::Set(i, b) => body[16 + i % span] = *b,
        Mutation::Insert(i, v) => {
            let at = 16 + i % (span + 1);
            body.splice(at..at, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let at = 16 + i % span;
            let end = (at + n).min(body.len());
            body.drain(at..end);
        }
        Mutation::Word(i, w) => {
            let at = 16 + i % span;
            for (k, b) in w.to_le_bytes().iter().enumerate() {
                if at + k < body.len() {
                    body[at + k] = *b;
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// Mutated metadata with valid framing: decoded or rejected, never a panic;
    /// whatever decodes re-encodes to the same bytes (nothing half-parsed).
    #[test]
    fn mutated_metadata_never_panics(regions in 0u32..4, muts in proptest::collection::vec(mutation(), 1..6)) {
        let enc = sample_meta(regions).encode();
        let mut body = enc[..enc.len() - 4].to_vec();
        for m in &muts {
            apply(&mut body, m);
        }
        let framed = reframe(body);
        match PeerMeta::decode(&framed) {
            Ok(meta) => prop_assert_eq!(meta.encode(), framed),
            Err(e) => prop_assert!(matches!(e, PdgateError::RejectedMetadata(_)), "unexpected error kind {e:?}"),
        }
    }

    /// Arbitrary payload after a valid header: never a panic.
    #[test]
    fn arbitrary_payload_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..600)) {
        let enc = sample_meta(1).encode();
        let mut body = enc[..16].to_vec();
        body.extend_from_slice(&payload);
        let _ = PeerMeta::decode(&reframe(body));
    }

    /// Region geometry from arbitrary integers: a layout is built or refused,
    /// and a built one keeps every block inside the region.
    #[test]
    fn arbitrary_geometry_never_panics(base: u64, len: u64, bl: u64, stride: u64, count: u64, id: u64) {
        if let Ok(r) = RegionLayout::new(base, len, bl, stride, count, MemType::Host) {
            match r.block_offset(id) {
                Ok(off) => prop_assert!(off.checked_add(r.block_len).map_or(false, |e| e <= r.len)),
                Err(e) => prop_assert!(matches!(e, PdgateError::OutOfRange(_))),
            }
        }
    }

    /// Random (often out-of-range, duplicated, mismatched) block id lists:
    /// a plan or an error, never a panic; a plan stays inside both regions.
    #[test]
    fn random_block_ids_never_panic(
        n_local in 1u64..64, n_remote in 1u64..64, bl in 1u64..4096, extra in 0u64..64, dest_local: bool,
        local_ids in proptest::collection::vec(prop_oneof![0u64..80, any::<u64>()], 0..40),
        remote_ids in proptest::collection::vec(prop_oneof![0u64..80, any::<u64>()], 0..40),
    ) {
        let stride = bl + extra;
        let local = RegionLayout::new(0, n_local * stride, bl, stride, n_local, MemType::Host).unwrap();
        let remote = RegionLayout::new(u64::MAX / 2, n_remote * stride, bl, stride, n_remote, MemType::Host).unwrap();
        match plan_segments(&local, &remote, &local_ids, &remote_ids, dest_local) {
            Ok(segs) => {
                prop_assert_eq!(plan_bytes(&segs), bl * local_ids.len() as u64);
                for s in &segs {
                    prop_assert!(s.local_off + s.len <= local.len && s.remote_off + s.len <= remote.len);
                }
            }
            Err(e) => prop_assert!(matches!(e, PdgateError::OutOfRange(_) | PdgateError::InvalidArgument(_))),
        }
    }
}
