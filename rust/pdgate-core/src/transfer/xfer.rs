//! Per-transfer state machine on the progress thread.
//!
//! A transfer is planned and bounds-checked in full before anything is
//! posted. Then: post every coalesced segment (GET for reads, PUT for
//! writes) in one batch -> writes flush the endpoint (remote completion) ->
//! reads holding a lease GET the owner's lease word and fail with
//! `LeaseExpired` unless it still holds the granted epoch -> the optional
//! notification is sent as an active message -> the result is published.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use super::ffi::{self, *};
use super::layout::{plan_segments, Segment};
use super::shared::Catalog;
use super::worker::{req_cb, Worker, AM_NOTIFY};
use crate::error::{PdgateError, Result};

/// A transfer planned on the caller's thread (see [`plan_xfer`]): the
/// progress thread only resolves handles and posts.
pub(crate) struct XferReq {
    pub id: u64,
    pub write: bool,
    pub peer: String,
    /// The peer's key when planned (a re-added peer gets a new one).
    pub peer_key: u64,
    /// (local region id, remote region id, index into `segs`).
    pub pairs: Vec<(u32, u32, usize)>,
    /// Segment plans, one per distinct pair geometry.
    pub segs: Vec<Vec<Segment>>,
    pub notify: Option<Vec<u8>>,
    pub lease: Option<(u32, u64)>,
    pub timeout: Duration,
}

/// A planned transfer's peer key, region pairs and segments.
pub(crate) type Plan = (u64, Vec<(u32, u32, usize)>, Vec<Vec<Segment>>);

/// Check and plan a transfer against the catalog, before anything is
/// posted: unknown or failed peer, unknown regions, block ids out of range,
/// mismatched lists (the synchronous errors of `read_blocks` / `write_blocks`).
/// `pairs` empty = every local region in id order paired with every peer
/// region in id order.
pub(crate) fn plan_xfer(
    cat: &Catalog,
    peer: &str,
    write: bool,
    pairs: &[(u32, u32)],
    local_ids: &[u64],
    remote_ids: &[u64],
    lease: Option<(u32, u64)>,
) -> Result<Plan> {
    let p = match cat.peers.get(peer) {
        Some(p) => p,
        None => {
            return Err(match cat.dead.get(peer) {
                Some(e) => e.clone(),
                None => PdgateError::NotFound(format!("peer {peer:?} (call add_peer first)")),
            })
        }
    };
    if lease.is_some() && write {
        return Err(PdgateError::InvalidArgument(
            "leases guard reads; write_blocks takes none".into(),
        ));
    }
    if let Some((slot, _)) = lease {
        if slot >= p.lease_slots {
            return Err(PdgateError::InvalidArgument(format!(
                "lease slot {slot} outside the peer's table"
            )));
        }
    }
    let defaulted: Vec<(u32, u32)>;
    let pairs = if pairs.is_empty() {
        let mut l: Vec<u32> = cat.regions.keys().copied().collect();
        let mut r: Vec<u32> = p.regions.keys().copied().collect();
        l.sort_unstable();
        r.sort_unstable();
        if l.len() != r.len() || l.is_empty() {
            return Err(PdgateError::InvalidArgument(format!(
                "{} local vs {} peer regions: pass regions= and remote_regions= explicitly",
                l.len(),
                r.len()
            )));
        }
        defaulted = l.into_iter().zip(r).collect();
        &defaulted[..]
    } else {
        pairs
    };
    let mut out = Vec::with_capacity(pairs.len());
    let mut distinct: Vec<Geometry> = Vec::new();
    let mut segs: Vec<Vec<Segment>> = Vec::new();
    for &(li, ri) in pairs {
        let l = cat
            .regions
            .get(&li)
            .ok_or_else(|| PdgateError::NotFound(format!("local region {li}")))?;
        let rl = p
            .regions
            .get(&ri)
            .ok_or_else(|| PdgateError::NotFound(format!("region {ri} of peer {peer:?}")))?;
        let g = (
            l.block_len,
            l.block_stride,
            l.block_count,
            rl.block_len,
            rl.block_stride,
            rl.block_count,
        );
        let idx = match distinct.iter().position(|d| *d == g) {
            Some(i) => i,
            None => {
                segs.push(plan_segments(l, rl, local_ids, remote_ids, !write)?);
                distinct.push(g);
                segs.len() - 1
            }
        };
        out.push((li, ri, idx));
    }
    Ok((p.key, out, segs))
}

/// (block_len, stride, count) of the local then the remote region: pairs
/// with equal geometry share one plan (offsets are relative to the bases).
type Geometry = (u64, u64, u64, u64, u64, u64);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    Data,
    Flush,
    LeaseCheck,
    Notify,
    Done,
}

pub(crate) struct Xfer {
    peer_key: u64,
    write: bool,
    outstanding: usize,
    stage: Stage,
    failed: Option<PdgateError>,
    reported: bool,
    lease: Option<(u32, u64)>,
    lease_buf: Box<u64>,
    lease_posted: bool,
    am: Option<Vec<u8>>,
    deadline: Instant,
    regions: Vec<u32>,
}

fn param(id: u64) -> ucp_request_param_t {
    let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb = Some(req_cb);
    p.user_data = id as *mut c_void;
    p
}

impl Worker {
    /// Post a planned transfer. An error here (the peer or a region went
    /// away since the caller planned it) is published as the transfer's
    /// result by the caller of this function.
    pub(crate) fn start_xfer(&mut self, r: XferReq) -> Result<()> {
        let peer = match self.peers.get(&r.peer) {
            Some(p) if p.key == r.peer_key => p,
            Some(_) => {
                return Err(PdgateError::NotFound(format!(
                    "peer {:?} was re-added after the transfer was submitted",
                    r.peer
                )))
            }
            None => {
                return Err(match self.dead.get(&r.peer) {
                    Some(e) => e.clone(),
                    None => PdgateError::NotFound(format!("peer {:?} (removed)", r.peer)),
                })
            }
        };
        // Resolve handles; nothing is posted unless all are present.
        let mut plans: Vec<(u64, ucp_mem_h, u64, ucp_rkey_h, usize)> =
            Vec::with_capacity(r.pairs.len());
        for &(li, ri, idx) in &r.pairs {
            let lr = self
                .regions
                .get(&li)
                .ok_or_else(|| PdgateError::NotFound(format!("local region {li}")))?;
            let (rl, rk) = peer.regions.get(&ri).ok_or_else(|| {
                PdgateError::NotFound(format!("region {ri} of peer {:?}", r.peer))
            })?;
            plans.push((lr.layout.base, lr.memh, rl.base, *rk, idx));
        }
        let am = r.notify.as_ref().map(|msg| {
            let (slot, epoch) = r.lease.unwrap_or((u32::MAX, 0));
            let mut b = Vec::with_capacity(14 + self.init.engine_id.len() + msg.len());
            b.extend_from_slice(&slot.to_le_bytes());
            b.extend_from_slice(&epoch.to_le_bytes());
            b.extend_from_slice(&(self.init.engine_id.len() as u16).to_le_bytes());
            b.extend_from_slice(self.init.engine_id.as_bytes());
            b.extend_from_slice(msg);
            b
        });
        let (ep, peer_key) = (peer.ep, peer.key);
        let mut regions: Vec<u32> = r.pairs.iter().map(|p| p.0).collect();
        regions.sort_unstable();
        regions.dedup();
        for id in &regions {
            self.regions.get_mut(id).unwrap().inflight += 1;
        }
        self.peers.get_mut(&r.peer).unwrap().inflight += 1;
        let mut x = Xfer {
            peer_key,
            write: r.write,
            outstanding: 0,
            stage: Stage::Data,
            failed: None,
            reported: false,
            lease: r.lease,
            lease_buf: Box::new(0),
            lease_posted: false,
            am,
            deadline: Instant::now() + r.timeout,
            regions,
        };
        let ucp = self.ucp;
        'post: for (lbase, memh, rbase, rkey, idx) in &plans {
            let mut prm = param(r.id);
            prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = *memh;
            for s in &r.segs[*idx] {
                let (la, ra) = ((lbase + s.local_off) as *mut c_void, rbase + s.remote_off);
                let st = unsafe {
                    if r.write {
                        (ucp.ucp_put_nbx)(ep, la, s.len as usize, ra, *rkey, &prm)
                    } else {
                        (ucp.ucp_get_nbx)(ep, la, s.len as usize, ra, *rkey, &prm)
                    }
                };
                if !track(
                    &mut x,
                    st,
                    if r.write {
                        "ucp_put_nbx"
                    } else {
                        "ucp_get_nbx"
                    },
                ) {
                    break 'post;
                }
            }
        }
        self.xfers.insert(r.id, x);
        self.advance(r.id);
        Ok(())
    }

    /// Move a transfer through its stages while nothing is outstanding.
    fn advance(&mut self, id: u64) {
        loop {
            let Some(x) = self.xfers.get_mut(&id) else {
                return;
            };
            if x.outstanding > 0 {
                return;
            }
            if x.failed.is_some() || x.stage == Stage::Done {
                let x = self.xfers.remove(&id).unwrap();
                self.finish(id, x);
                return;
            }
            let ep = match self
                .peer_keys
                .get(&x.peer_key)
                .and_then(|n| self.peers.get(n))
            {
                Some(p) => p,
                None => {
                    x.failed = Some(PdgateError::PeerUnreachable(
                        "peer removed during transfer".into(),
                    ));
                    continue;
                }
            };
            let (ep_h, lease_base, lease_rkey) = (ep.ep, ep.lease_base, ep.lease_rkey);
            let ucp = self.ucp;
            match x.stage {
                Stage::Data => {
                    x.stage = if x.write {
                        Stage::Flush
                    } else {
                        Stage::LeaseCheck
                    };
                    if x.write {
                        let st = unsafe { (ucp.ucp_ep_flush_nbx)(ep_h, &param(id)) };
                        track(x, st, "ucp_ep_flush_nbx");
                    }
                }
                Stage::Flush => x.stage = Stage::LeaseCheck,
                Stage::LeaseCheck => {
                    if let Some((slot, epoch)) = x.lease {
                        if !x.lease_posted {
                            // Post the lease-word GET; come back when it lands.
                            x.lease_posted = true;
                            let buf = &mut *x.lease_buf as *mut u64 as *mut c_void;
                            let st = unsafe {
                                (ucp.ucp_get_nbx)(
                                    ep_h,
                                    buf,
                                    8,
                                    lease_base + slot as u64 * 8,
                                    lease_rkey,
                                    &param(id),
                                )
                            };
                            track(x, st, "lease check");
                            continue;
                        }
                        if *x.lease_buf != epoch {
                            x.failed = Some(PdgateError::LeaseExpired(format!(
                                "lease (slot {slot}, epoch {epoch}) expired or released before the read finished; data discarded"
                            )));
                            continue;
                        }
                    }
                    x.stage = Stage::Notify;
                }
                Stage::Notify => {
                    x.stage = Stage::Done;
                    if let Some(am) = &x.am {
                        let mut prm = param(id);
                        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
                        prm.flags = UCP_AM_SEND_FLAG_EAGER;
                        let st = unsafe {
                            (ucp.ucp_am_send_nbx)(
                                ep_h,
                                AM_NOTIFY,
                                std::ptr::null(),
                                0,
                                am.as_ptr() as *const c_void,
                                am.len(),
                                &prm,
                            )
                        };
                        track(x, st, "notify");
                    }
                }
                Stage::Done => {}
            }
        }
    }

    fn finish(&mut self, id: u64, x: Xfer) {
        for r in &x.regions {
            if let Some(reg) = self.regions.get_mut(r) {
                reg.inflight -= 1;
            }
        }
        if let Some(p) = self
            .peer_keys
            .get(&x.peer_key)
            .and_then(|n| self.peers.get_mut(n))
        {
            p.inflight -= 1;
        }
        if !x.reported {
            self.shared.complete(id, x.failed.map_or(Ok(()), Err));
        }
    }

    pub(crate) fn on_req_done(&mut self, id: u64, status: ucs_status_t) {
        let dead = self.dead_reason(id);
        let Some(x) = self.xfers.get_mut(&id) else {
            return;
        };
        x.outstanding -= 1;
        if status != UCS_OK && x.failed.is_none() {
            x.failed = Some(dead.unwrap_or_else(|| ffi::status_err("transfer", status)));
        }
        self.advance(id);
    }

    fn dead_reason(&self, id: u64) -> Option<PdgateError> {
        let x = self.xfers.get(&id)?;
        self.dead_by_key.get(&x.peer_key).cloned()
    }

    /// Endpoint failure (peer died, connection reset, keepalive timeout):
    /// fail its transfers and force-close it.
    pub(crate) fn on_ep_error(&mut self, key: u64, status: ucs_status_t) {
        let err = match ffi::status_err("endpoint failed", status) {
            PdgateError::PeerUnreachable(m)
            | PdgateError::Transport(m)
            | PdgateError::Timeout(m) => PdgateError::PeerUnreachable(m),
            o => o,
        };
        self.kill_peer(key, err);
    }

    pub(crate) fn kill_peer(&mut self, key: u64, err: PdgateError) {
        let Some(name) = self.peer_keys.get(&key).cloned() else {
            return;
        };
        self.dead.insert(name.clone(), err.clone());
        self.dead_by_key.insert(key, err.clone());
        for x in self.xfers.values_mut() {
            if x.peer_key == key && x.failed.is_none() {
                x.failed = Some(err.clone());
            }
        }
        if let Some(p) = self.peers.get_mut(&name) {
            p.failed = Some(err);
        }
        self.drop_peer(&name, true);
        self.publish();
        let ids: Vec<u64> = self
            .xfers
            .iter()
            .filter(|(_, x)| x.peer_key == key)
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            self.advance(id);
        }
    }

    /// Report transfers past their deadline now; force-close their peer so
    /// UCX releases their buffers.
    pub(crate) fn check_deadlines(&mut self, now: Instant) {
        let late: Vec<(u64, u64)> = self
            .xfers
            .iter()
            .filter(|(_, x)| !x.reported && x.deadline <= now)
            .map(|(id, x)| (*id, x.peer_key))
            .collect();
        for (id, key) in late {
            let timeout = PdgateError::Timeout(format!(
                "transfer {id} did not finish in time; peer endpoint closed"
            ));
            // Force-close first, publish after: a caller woken by the
            // timeout then finds the peer failed, and the endpoint closed
            // when it reuses or frees the buffers.
            if let Some(x) = self.xfers.get_mut(&id) {
                if !x.reported {
                    x.reported = true;
                    x.failed.get_or_insert_with(|| timeout.clone());
                }
            }
            self.kill_peer(
                key,
                PdgateError::PeerUnreachable(
                    "peer timed out (a transfer missed its deadline)".into(),
                ),
            );
            // Let UCX cancel the transfer's operations (bounded), so that
            // none writes into the buffers once the caller hears of it.
            let until = Instant::now() + Duration::from_millis(100);
            while self.xfers.contains_key(&id) && Instant::now() < until {
                unsafe { (self.ucp.ucp_worker_progress)(self.worker) };
                self.drain_events();
            }
            self.shared.complete(id, Err(timeout));
        }
    }

    /// Publish a failure now (resources are released when UCX is done).
    pub(crate) fn fail_xfer(&mut self, id: u64, err: PdgateError) {
        if let Some(x) = self.xfers.get_mut(&id) {
            if !x.reported {
                x.reported = true;
                if x.failed.is_none() {
                    x.failed = Some(err.clone());
                }
                self.shared.complete(id, Err(err));
            }
        }
        self.advance(id);
    }

    pub(crate) fn on_notify(&mut self, b: &[u8]) {
        if b.len() < 14 {
            return;
        }
        let slot = u32::from_le_bytes(b[..4].try_into().unwrap());
        let epoch = u64::from_le_bytes(b[4..12].try_into().unwrap());
        let n = u16::from_le_bytes([b[12], b[13]]) as usize;
        if b.len() < 14 + n {
            return;
        }
        let peer = String::from_utf8_lossy(&b[14..14 + n]).into_owned();
        let msg = b[14 + n..].to_vec();
        let released_lease = if slot != u32::MAX {
            self.shared.leases.lock().release_token(slot, epoch)
        } else {
            None
        };
        self.shared
            .notifs
            .lock()
            .push_back(super::shared::Notification {
                peer,
                msg,
                released_lease,
            });
        self.shared.signal_event();
    }
}

/// Account for one posted operation; false when it failed immediately.
fn track(x: &mut Xfer, st: ucs_status_ptr_t, what: &str) -> bool {
    match ffi::status_ptr(st) {
        Ok(Some(_)) => {
            x.outstanding += 1;
            true
        }
        Ok(None) => true,
        Err(s) => {
            if x.failed.is_none() {
                x.failed = Some(ffi::status_err(what, s));
            }
            false
        }
    }
}
