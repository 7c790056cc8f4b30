//! Peers on the progress thread: endpoint creation from a peer's metadata,
//! rkey unpacking, and teardown (endpoint close, then rkey destruction once
//! UCX has released every operation that used them).

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use super::ffi::{self, *};
use super::meta::PeerMeta;
use super::worker::{ep_err_cb, Peer, Worker};
use crate::error::{PdgateError, Result};

impl Worker {
    pub(crate) fn add_peer(&mut self, m: PeerMeta) -> Result<String> {
        if m.compat_hash != self.init.compat_hash {
            return Err(PdgateError::RejectedMetadata(format!(
                "peer {:?} KV layout hash {:#x} != ours {:#x} (block layout, dtype, block size or layer count differ)",
                m.engine_id, m.compat_hash, self.init.compat_hash
            )));
        }
        self.dead.remove(&m.engine_id);
        if self.peers.contains_key(&m.engine_id) {
            self.drop_peer(&m.engine_id.clone(), true);
        }
        let key = self.next_peer;
        self.next_peer += 1;
        unsafe {
            let mut p: ucp_ep_params_t = std::mem::zeroed();
            p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | UCP_EP_PARAM_FIELD_ERR_HANDLER;
            p.address = m.worker_addr.as_ptr() as *const c_void;
            p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
            p.err_handler_cb = Some(ep_err_cb);
            p.err_handler_arg = key as *mut c_void;
            let mut ep = null_mut();
            if self.no_peer_err {
                p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
                p.err_mode = 0;
            }
            let mut st = (self.ucp.ucp_ep_create)(self.worker, &p, &mut ep);
            if st == -6 && !self.no_peer_err {
                self.no_peer_err = true;
                // Shared-memory transports (posix/sysv) have no peer-failure
                // support: connect without it. Peer death then surfaces as
                // failed operations (cma) or the transfer deadline.
                p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
                p.err_mode = 0;
                st = (self.ucp.ucp_ep_create)(self.worker, &p, &mut ep);
            }
            if st != UCS_OK {
                let e = ffi::status_err("ucp_ep_create", st);
                return Err(match e {
                    PdgateError::Transport(t) => PdgateError::PeerUnreachable(t),
                    o => o,
                });
            }
            let mut peer = Peer {
                key,
                ep,
                regions: HashMap::new(),
                lease_base: m.lease_base,
                lease_slots: m.lease_slots,
                lease_rkey: null_mut(),
                failed: None,
                inflight: 0,
            };
            let unpack = |b: &[u8]| -> Result<ucp_rkey_h> {
                let mut rk = null_mut();
                let st = (self.ucp.ucp_ep_rkey_unpack)(ep, b.as_ptr() as *const c_void, &mut rk);
                if st != UCS_OK {
                    return Err(PdgateError::RejectedMetadata(format!(
                        "rkey unpack: {}",
                        ffi::status_str(st)
                    )));
                }
                Ok(rk)
            };
            let res = (|| -> Result<()> {
                peer.lease_rkey = unpack(&m.lease_rkey)?;
                for r in &m.regions {
                    let rk = unpack(&r.rkey)?;
                    peer.regions.insert(r.id, (r.layout, rk));
                }
                Ok(())
            })();
            self.peer_keys.insert(key, m.engine_id.clone());
            self.peers.insert(m.engine_id.clone(), peer);
            if let Err(e) = res {
                self.drop_peer(&m.engine_id, true);
                return Err(e);
            }
        }
        Ok(m.engine_id)
    }

    /// Close a peer's endpoint (forced when `force` or it failed) and
    /// destroy its rkeys once the close completes.
    pub(crate) fn drop_peer(&mut self, id: &str, force: bool) {
        let Some(p) = self.peers.remove(id) else {
            return;
        };
        self.peer_keys.remove(&p.key);
        self.close_ep(p, force);
    }

    pub(crate) fn close_ep(&mut self, p: Peer, force: bool) {
        let mut rkeys: Vec<ucp_rkey_h> = p.regions.values().map(|v| v.1).collect();
        if !p.lease_rkey.is_null() {
            rkeys.push(p.lease_rkey);
        }
        let mut prm: ucp_request_param_t = unsafe { std::mem::zeroed() };
        if force || p.failed.is_some() || p.inflight > 0 {
            prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
        } else {
            // Graceful: rkeys first, then flush-and-close.
            for rk in rkeys.drain(..) {
                unsafe { (self.ucp.ucp_rkey_destroy)(rk) };
            }
        }
        let r = unsafe { (self.ucp.ucp_ep_close_nbx)(p.ep, &prm) };
        let req = ffi::status_ptr(r).ok().flatten();
        self.closing
            .push((req, rkeys, Instant::now() + Duration::from_secs(2)));
    }

    pub(crate) fn reap_closing(&mut self, now: Instant) {
        let ucp = self.ucp;
        self.closing.retain_mut(|(req, rkeys, deadline)| {
            if let Some(r) = *req {
                let st = unsafe { (ucp.ucp_request_check_status)(r) };
                if st == UCS_INPROGRESS && now < *deadline {
                    return true;
                }
                if st != UCS_INPROGRESS {
                    unsafe { (ucp.ucp_request_free)(r) };
                } else {
                    // Give up waiting; leak the request and rkeys rather than
                    // free what UCX may still touch.
                    rkeys.clear();
                    return false;
                }
            }
            for rk in rkeys.drain(..) {
                unsafe { (ucp.ucp_rkey_destroy)(rk) };
            }
            false
        });
    }
}
