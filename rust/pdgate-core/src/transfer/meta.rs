//! Peer metadata: what one engine tells another so it can read and write its
//! registered regions. Serialized to bytes (little endian), checksummed, and
//! validated field by field on the way in; anything off is
//! `PdgateError::RejectedMetadata`.
//!
//! Layout: magic `PDGTXMD\0`, u16 protocol version, u16 flags (0), u32 total
//! length, u64 compatibility hash, u16+engine id (UTF-8), u32+worker
//! address, lease table (u64 base, u32 slots, u32+rkey), u32 region count,
//! per region (u32 id, u64 base, u64 len, u64 block_len, u64 block_stride,
//! u64 block_count, u8 mem type, u32+packed rkey), then CRC-32 of all the
//! preceding bytes.

use super::layout::{MemType, RegionLayout};
use crate::error::{PdgateError, Result};

/// Metadata wire protocol version; peers must match exactly.
pub const PROTOCOL_VERSION: u16 = 1;
const MAGIC: &[u8; 8] = b"PDGTXMD\0";
const MAX_ID: usize = 256;
const MAX_BLOB: usize = 1 << 20;
const MAX_REGIONS: usize = 1 << 16;

/// One registered region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionDesc {
    /// Region id, stable for the life of the registration.
    pub id: u32,
    /// Geometry.
    pub layout: RegionLayout,
    /// Packed UCX remote key.
    pub rkey: Vec<u8>,
}

/// Everything a peer needs to reach this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerMeta {
    pub engine_id: String,
    pub compat_hash: u64,
    pub worker_addr: Vec<u8>,
    /// Lease table: `lease_slots` u64 words at `lease_base`.
    pub lease_base: u64,
    pub lease_slots: u32,
    pub lease_rkey: Vec<u8>,
    pub regions: Vec<RegionDesc>,
}

/// FNV-1a 64 of a compatibility description (block layout, dtype, block
/// size, layer count...). Engines only pair with equal hashes.
pub fn compat_hash(desc: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in desc.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// CRC-32 (IEEE, reflected), bitwise; metadata is small.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

impl PeerMeta {
    /// Serialize.
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(256 + self.worker_addr.len() + self.regions.len() * 128);
        o.extend_from_slice(MAGIC);
        o.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        o.extend_from_slice(&0u16.to_le_bytes());
        o.extend_from_slice(&0u32.to_le_bytes()); // total length, patched below
        o.extend_from_slice(&self.compat_hash.to_le_bytes());
        o.extend_from_slice(&(self.engine_id.len() as u16).to_le_bytes());
        o.extend_from_slice(self.engine_id.as_bytes());
        put_blob(&mut o, &self.worker_addr);
        o.extend_from_slice(&self.lease_base.to_le_bytes());
        o.extend_from_slice(&self.lease_slots.to_le_bytes());
        put_blob(&mut o, &self.lease_rkey);
        o.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            let l = &r.layout;
            o.extend_from_slice(&r.id.to_le_bytes());
            for v in [l.base, l.len, l.block_len, l.block_stride, l.block_count] {
                o.extend_from_slice(&v.to_le_bytes());
            }
            o.push(l.mem_type.code());
            put_blob(&mut o, &r.rkey);
        }
        let total = (o.len() + 4) as u32;
        o[12..16].copy_from_slice(&total.to_le_bytes());
        let c = crc32(&o);
        o.extend_from_slice(&c.to_le_bytes());
        o
    }

    /// Parse and validate; never panics on any input.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let rej = |m: &str| PdgateError::RejectedMetadata(m.to_string());
        if b.len() < 24 || &b[..8] != MAGIC {
            return Err(rej("not pdgate transfer metadata (bad magic or too short)"));
        }
        let ver = u16::from_le_bytes([b[8], b[9]]);
        if ver != PROTOCOL_VERSION {
            return Err(PdgateError::RejectedMetadata(format!(
                "protocol version {ver}, this engine speaks {PROTOCOL_VERSION}"
            )));
        }
        let total = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
        if total != b.len() {
            return Err(PdgateError::RejectedMetadata(format!(
                "length field {total} != {} bytes received",
                b.len()
            )));
        }
        let body = &b[..b.len() - 4];
        let want = u32::from_le_bytes(b[b.len() - 4..].try_into().unwrap());
        if crc32(body) != want {
            return Err(rej("checksum mismatch (corrupted metadata)"));
        }
        let mut r = Reader { b: body, p: 16 };
        let compat_hash = r.u64()?;
        let idlen = r.u16()? as usize;
        if idlen == 0 || idlen > MAX_ID {
            return Err(rej("engine id length out of range"));
        }
        let engine_id = String::from_utf8(r.bytes(idlen)?.to_vec())
            .map_err(|_| rej("engine id is not UTF-8"))?;
        let worker_addr = r.blob()?;
        if worker_addr.is_empty() {
            return Err(rej("empty worker address"));
        }
        let lease_base = r.u64()?;
        let lease_slots = r.u32()?;
        let lease_rkey = r.blob()?;
        if lease_slots == 0
            || lease_rkey.is_empty()
            || lease_base.checked_add(lease_slots as u64 * 8).is_none()
        {
            return Err(rej("bad lease table descriptor"));
        }
        let n = r.u32()? as usize;
        if n > MAX_REGIONS {
            return Err(rej("too many regions"));
        }
        let mut regions = Vec::with_capacity(n.min(1024));
        let mut ids = std::collections::HashSet::new();
        for _ in 0..n {
            let id = r.u32()?;
            let (base, len, block_len, block_stride, block_count) =
                (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let mt = MemType::from_code(r.u8()?).ok_or_else(|| rej("unknown memory type"))?;
            let rkey = r.blob()?;
            let layout = RegionLayout {
                base,
                len,
                block_len,
                block_stride,
                block_count,
                mem_type: mt,
            };
            layout
                .validate()
                .map_err(|e| PdgateError::RejectedMetadata(format!("region {id}: {e}")))?;
            if rkey.is_empty() || !ids.insert(id) {
                return Err(PdgateError::RejectedMetadata(format!(
                    "region {id}: empty rkey or duplicate id"
                )));
            }
            regions.push(RegionDesc { id, layout, rkey });
        }
        if r.p != body.len() {
            return Err(rej("trailing bytes"));
        }
        Ok(PeerMeta {
            engine_id,
            compat_hash,
            worker_addr,
            lease_base,
            lease_slots,
            lease_rkey,
            regions,
        })
    }
}

fn put_blob(o: &mut Vec<u8>, b: &[u8]) {
    o.extend_from_slice(&(b.len() as u32).to_le_bytes());
    o.extend_from_slice(b);
}

struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.b.len() - self.p {
            return Err(PdgateError::RejectedMetadata("truncated".into()));
        }
        let s = &self.b[self.p..self.p + n];
        self.p += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    fn blob(&mut self) -> Result<Vec<u8>> {
        let n = self.u32()? as usize;
        if n > MAX_BLOB {
            return Err(PdgateError::RejectedMetadata("blob too large".into()));
        }
        Ok(self.bytes(n)?.to_vec())
    }
}

/// A valid metadata value with `regions` host regions (test fixture, shared
/// by the unit tests here and the fuzz tests).
#[cfg(test)]
pub(crate) fn sample_meta(regions: u32) -> PeerMeta {
    PeerMeta {
        engine_id: "prefill-0".into(),
        compat_hash: compat_hash("llama|bf16|16|32"),
        worker_addr: vec![1, 2, 3, 4, 5],
        lease_base: 0x7000,
        lease_slots: 64,
        lease_rkey: vec![9; 12],
        regions: (0..regions)
            .map(|i| RegionDesc {
                id: i,
                layout: RegionLayout::new(0x10000 * (i as u64 + 1), 4096, 512, 0, 0, MemType::Host)
                    .unwrap(),
                rkey: vec![i as u8 + 1; 20],
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> PeerMeta {
        sample_meta(3)
    }

    #[test]
    fn roundtrip() {
        let m = sample();
        assert_eq!(PeerMeta::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn crc_known_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF43926);
    }

    #[test]
    fn rejects_version_and_truncation() {
        let mut b = sample().encode();
        assert!(PeerMeta::decode(&b[..b.len() - 1]).is_err());
        b[8] = 9;
        assert!(
            matches!(PeerMeta::decode(&b), Err(PdgateError::RejectedMetadata(m)) if m.contains("version"))
        );
        assert!(PeerMeta::decode(b"").is_err());
        assert!(PeerMeta::decode(b"garbage garbage garbage garbage").is_err());
    }

    proptest! {
        /// Flipping any bit is detected.
        #[test]
        fn any_bitflip_rejected(pos in 0usize..10_000, bit in 0u8..8) {
            let b = sample().encode();
            let mut c = b.clone();
            let i = pos % c.len();
            c[i] ^= 1 << bit;
            prop_assert!(matches!(PeerMeta::decode(&c), Err(PdgateError::RejectedMetadata(_))));
        }

        /// Arbitrary bytes never panic and (practically) never parse.
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = PeerMeta::decode(&data);
        }
    }
}
