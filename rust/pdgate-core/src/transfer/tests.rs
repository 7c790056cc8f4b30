//! In-process engine tests (two engines, one process). Skipped when no
//! `libucp` is found: set `PDGATE_UCP_LIB` or install `libucx-cu12` in the
//! repo's `.venv`.

use std::path::PathBuf;
use std::time::Duration;

use super::*;
use crate::error::PdgateError;

fn ucp_lib() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("PDGATE_UCP_LIB") {
        return Some(p.into());
    }
    if let Ok(d) = std::env::var("PDGATE_UCX_LIB_DIR") {
        return Some(PathBuf::from(d).join("libucp.so.0"));
    }
    let mut venvs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv")];
    if let Ok(v) = std::env::var("VIRTUAL_ENV") {
        venvs.insert(0, v.into());
    }
    for venv in venvs {
        let Ok(rd) = std::fs::read_dir(venv.join("lib")) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path().join("site-packages/libucx/lib/libucp.so.0");
            if p.exists() {
                return Some(p);
            }
        }
    }
    None
}

fn engine(id: &str, tls: &str) -> Option<TransferEngine> {
    let lib = ucp_lib()?;
    Some(
        TransferEngine::new(EngineConfig {
            engine_id: id.into(),
            compat: "test|u8|4".into(),
            ucp_lib: Some(lib),
            transports: Some(tls.into()),
            ..Default::default()
        })
        .unwrap(),
    )
}

fn run_pair(tls: &str) {
    let (Some(a), Some(b)) = (
        engine(&format!("owner-{tls}"), tls),
        engine(&format!("reader-{tls}"), tls),
    ) else {
        eprintln!("libucp not found; skipping");
        return;
    };
    const BL: usize = 256;
    const N: usize = 64;
    let src: Vec<u8> = (0..BL * N).map(|i| (i * 7 + i / BL) as u8).collect();
    let mut dst = vec![0u8; BL * N];
    let ra = a
        .register(
            src.as_ptr() as u64,
            src.len() as u64,
            BL as u64,
            0,
            0,
            MemType::Host,
        )
        .unwrap();
    let rb = b
        .register(
            dst.as_mut_ptr() as u64,
            dst.len() as u64,
            BL as u64,
            0,
            0,
            MemType::Host,
        )
        .unwrap();
    assert_eq!((ra, rb), (0, 0));
    let peer = b.add_peer(&a.metadata().unwrap()).unwrap();
    let lease = a.grant_lease("req-1", Duration::from_secs(10)).unwrap();
    let local = vec![3u64, 4, 5, 10, 63];
    let remote = vec![0u64, 1, 2, 40, 7];
    let id = b
        .read_blocks(
            &peer,
            BlockTransfer {
                local_blocks: local.clone(),
                remote_blocks: remote.clone(),
                notify: Some(b"req-1".to_vec()),
                lease: Some(lease),
                ..Default::default()
            },
        )
        .unwrap();
    b.wait(id, Some(Duration::from_secs(10))).unwrap();
    for (l, r) in local.iter().zip(&remote) {
        let (l, r) = (*l as usize, *r as usize);
        assert_eq!(&dst[l * BL..(l + 1) * BL], &src[r * BL..(r + 1) * BL]);
    }
    assert_eq!(dst[0..BL], [0u8; BL]);
    // Notification reaches the owner and releases the lease.
    let t0 = std::time::Instant::now();
    let n = loop {
        let v = a.get_notifications();
        if !v.is_empty() {
            break v;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no notification");
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(n[0].msg, b"req-1");
    assert_eq!(n[0].peer, format!("reader-{tls}"));
    assert_eq!(n[0].released_lease.as_deref(), Some("req-1"));
    // Out of range: error before posting.
    let e = b.read_blocks(
        &peer,
        BlockTransfer {
            local_blocks: vec![0],
            remote_blocks: vec![64],
            ..Default::default()
        },
    );
    assert!(matches!(e, Err(PdgateError::OutOfRange(_))), "{e:?}");
    // Lease expiry then read.
    let lease = a.grant_lease("req-2", Duration::from_millis(20)).unwrap();
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(a.expired_leases(), vec!["req-2".to_string()]);
    let id = b
        .read_blocks(
            &peer,
            BlockTransfer {
                local_blocks: vec![1],
                remote_blocks: vec![1],
                lease: Some(lease),
                ..Default::default()
            },
        )
        .unwrap();
    let e = b.wait(id, Some(Duration::from_secs(10)));
    assert!(matches!(e, Err(PdgateError::LeaseExpired(_))), "{e:?}");
    // Write (push) direction.
    dst.iter_mut().for_each(|x| *x = 0xAB);
    let mut src2 = vec![0u8; BL * N];
    let a2 = a
        .register(
            src2.as_mut_ptr() as u64,
            src2.len() as u64,
            BL as u64,
            0,
            0,
            MemType::Host,
        )
        .unwrap();
    let peer_a = a.add_peer(&b.metadata().unwrap()).unwrap();
    let id = a
        .write_blocks(
            &peer_a,
            BlockTransfer {
                pairs: vec![(ra, rb)],
                local_blocks: vec![9, 10],
                remote_blocks: vec![20, 21],
                ..Default::default()
            },
        )
        .unwrap();
    a.wait(id, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(&dst[20 * BL..22 * BL], &src[9 * BL..11 * BL]);
    assert!(a.deregister(a2).is_ok());
    drop(src2);
    // Corrupted metadata.
    let mut m = a.metadata().unwrap();
    let k = m.len() / 2;
    m[k] ^= 0x40;
    assert!(matches!(
        b.add_peer(&m),
        Err(PdgateError::RejectedMetadata(_))
    ));
    b.close();
    a.close();
}

#[test]
fn tcp_pair() {
    run_pair("tcp");
}

#[test]
fn sm_pair() {
    run_pair("sm");
}

#[test]
fn dead_port_handshake() {
    let e = fetch_metadata("127.0.0.1:1", Duration::from_secs(1));
    assert!(matches!(e, Err(PdgateError::PeerUnreachable(_))), "{e:?}");
}
