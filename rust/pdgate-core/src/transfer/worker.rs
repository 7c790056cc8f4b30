//! The progress thread: sole owner of the UCP context and worker. Callers
//! reach it only through [`Cmd`] messages; it posts operations, progresses
//! UCX, runs the per-transfer state machine (see `xfer.rs`), expires leases
//! and sleeps on UCX's event fd when idle.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::ptr::null_mut;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::ffi::{self, *};
use super::layout::{MemType, RegionLayout};
use super::meta::{PeerMeta, RegionDesc};
use super::shared::{Catalog, PeerView, Shared};
use super::xfer::{Xfer, XferReq};
use crate::error::{PdgateError, Result};

/// Active-message id used for notifications.
pub(crate) const AM_NOTIFY: u32 = 0x5d;

pub(crate) enum Cmd {
    Register(RegionLayout, Sender<Result<u32>>),
    Deregister(u32, Sender<Result<()>>),
    Metadata(Sender<Result<Vec<u8>>>),
    AddPeer(Box<PeerMeta>, Sender<Result<String>>),
    RemovePeer(String, Sender<Result<()>>),
    /// Planned by the caller; no reply (errors become the transfer's result).
    Xfer(Box<XferReq>),
    Shutdown,
}

/// Events raised inside UCX callbacks (always on this thread, inside
/// `ucp_worker_progress`), handled right after.
pub(crate) enum Ev {
    Req { xfer: u64, status: ucs_status_t },
    EpErr { peer: u64, status: ucs_status_t },
    Am(Vec<u8>),
}

thread_local! {
    pub(crate) static EVENTS: RefCell<Vec<Ev>> = const { RefCell::new(Vec::new()) };
}

pub(crate) unsafe extern "C" fn req_cb(
    req: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    EVENTS.with(|e| {
        e.borrow_mut().push(Ev::Req {
            xfer: user_data as u64,
            status,
        })
    });
    (ffi::ucp().ucp_request_free)(req);
}

pub(crate) unsafe extern "C" fn ep_err_cb(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    EVENTS.with(|e| {
        e.borrow_mut().push(Ev::EpErr {
            peer: arg as u64,
            status,
        })
    });
}

unsafe extern "C" fn am_cb(
    _arg: *mut c_void,
    _header: *const c_void,
    _hlen: usize,
    data: *mut c_void,
    len: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // Notifications are sent eager, so the data is here now; a rendezvous
    // message would need a receive call: ignore it (never sent by us).
    if !param.is_null() && (*param).recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        return UCS_OK;
    }
    let bytes = if len == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(data as *const u8, len).to_vec()
    };
    EVENTS.with(|e| e.borrow_mut().push(Ev::Am(bytes)));
    UCS_OK
}

pub(crate) struct Region {
    pub layout: RegionLayout,
    pub memh: ucp_mem_h,
    pub rkey: Vec<u8>,
    pub inflight: usize,
}

pub(crate) struct Peer {
    pub key: u64,
    pub ep: ucp_ep_h,
    pub regions: HashMap<u32, (RegionLayout, ucp_rkey_h)>,
    pub lease_base: u64,
    pub lease_slots: u32,
    pub lease_rkey: ucp_rkey_h,
    pub failed: Option<PdgateError>,
    pub inflight: usize,
}

/// Settings fixed at start.
pub(crate) struct WorkerInit {
    pub engine_id: String,
    pub compat_hash: u64,
    pub transports: Option<String>,
    pub ucx_options: Vec<(String, String)>,
}

pub(crate) struct Worker {
    pub ucp: &'static Ucp,
    pub ctx: ucp_context_h,
    pub worker: ucp_worker_h,
    pub shared: Arc<Shared>,
    pub init: WorkerInit,
    pub address: Vec<u8>,
    pub regions: HashMap<u32, Region>,
    pub next_region: u32,
    pub lease_memh: ucp_mem_h,
    pub lease_rkey: Vec<u8>,
    pub peers: HashMap<String, Peer>,
    pub peer_keys: HashMap<u64, String>,
    pub next_peer: u64,
    pub xfers: HashMap<u64, Xfer>,
    /// Peers whose endpoint failed, with the reason (until re-added).
    pub dead: HashMap<String, PdgateError>,
    pub dead_by_key: HashMap<u64, PdgateError>,
    /// The transports cannot detect peer failure (shared memory only).
    pub no_peer_err: bool,
    /// Force-close requests in flight, with the rkeys to destroy afterwards.
    pub closing: Vec<(Option<*mut c_void>, Vec<ucp_rkey_h>, Instant)>,
}

fn check(what: &str, st: ucs_status_t) -> Result<()> {
    if st == UCS_OK {
        Ok(())
    } else {
        Err(ffi::status_err(what, st))
    }
}

impl Worker {
    /// Create context + worker + lease table registration. Runs on the
    /// progress thread.
    pub fn start(ucp: &'static Ucp, shared: Arc<Shared>, init: WorkerInit) -> Result<Self> {
        unsafe {
            let mut cfg: *mut ucp_config_t = null_mut();
            check(
                "ucp_config_read",
                (ucp.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut cfg),
            )?;
            let mut opts = init.ucx_options.clone();
            if let Some(t) = &init.transports {
                opts.push(("TLS".into(), t.clone()));
            }
            for (k, v) in &opts {
                let (ck, cv) = (cstr(k)?, cstr(v)?);
                let st = (ucp.ucp_config_modify)(cfg, ck.as_ptr(), cv.as_ptr());
                if st != UCS_OK {
                    (ucp.ucp_config_release)(cfg);
                    return Err(PdgateError::InvalidArgument(format!(
                        "UCX option {k}={v}: {}",
                        ffi::status_str(st)
                    )));
                }
            }
            let name = cstr(&init.engine_id)?;
            let params = ucp_params_t {
                field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                features: UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                request_size: 0,
                request_init: null_mut(),
                request_cleanup: null_mut(),
                tag_sender_mask: 0,
                mt_workers_shared: 0,
                estimated_num_eps: 0,
                estimated_num_ppn: 0,
                name: name.as_ptr(),
                node_local_id: 0,
            };
            let mut ctx = null_mut();
            let st = (ucp.ucp_init_version)(UCP_API_MAJOR, UCP_API_MINOR, &params, cfg, &mut ctx);
            (ucp.ucp_config_release)(cfg);
            check("ucp_init", st)?;
            let mut wp: ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
            wp.thread_mode = UCS_THREAD_MODE_SINGLE;
            let mut worker = null_mut();
            if let Err(e) = check(
                "ucp_worker_create",
                (ucp.ucp_worker_create)(ctx, &wp, &mut worker),
            ) {
                (ucp.ucp_cleanup)(ctx);
                return Err(e);
            }
            let mut w = Worker {
                ucp,
                ctx,
                worker,
                shared,
                init,
                address: Vec::new(),
                regions: HashMap::new(),
                next_region: 0,
                lease_memh: null_mut(),
                lease_rkey: Vec::new(),
                peers: HashMap::new(),
                peer_keys: HashMap::new(),
                next_peer: 1,
                xfers: HashMap::new(),
                dead: HashMap::new(),
                dead_by_key: HashMap::new(),
                no_peer_err: false,
                closing: Vec::new(),
            };
            // From here on, `Drop` tears down what exists.
            let mut attr: ucp_worker_attr_t = std::mem::zeroed();
            attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
            check(
                "ucp_worker_query",
                (ucp.ucp_worker_query)(worker, &mut attr),
            )?;
            w.address =
                std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec();
            (ucp.ucp_worker_release_address)(worker, attr.address);
            let am = ucp_am_handler_param_t {
                field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID
                    | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | UCP_AM_HANDLER_PARAM_FIELD_CB
                    | UCP_AM_HANDLER_PARAM_FIELD_ARG,
                id: AM_NOTIFY,
                flags: UCP_AM_FLAG_WHOLE_MSG,
                cb: Some(am_cb),
                arg: null_mut(),
            };
            check(
                "ucp_worker_set_am_recv_handler",
                (ucp.ucp_worker_set_am_recv_handler)(worker, &am),
            )?;
            let (base, len) = {
                let l = w.shared.leases.lock();
                (l.words.as_ptr() as u64, (l.words.len() * 8) as u64)
            };
            let (memh, rkey) = w.map(base, len, MemType::Host)?;
            w.lease_memh = memh;
            w.lease_rkey = rkey;
            Ok(w)
        }
    }

    /// `ucp_mem_map` + `ucp_rkey_pack`.
    fn map(&mut self, base: u64, len: u64, mt: MemType) -> Result<(ucp_mem_h, Vec<u8>)> {
        unsafe {
            let p = ucp_mem_map_params_t {
                field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                address: base as *mut c_void,
                length: len as usize,
                flags: 0,
                prot: 0,
                memory_type: match mt {
                    MemType::Host => UCS_MEMORY_TYPE_HOST,
                    MemType::Cuda => UCS_MEMORY_TYPE_CUDA,
                },
                exported_memh_buffer: std::ptr::null(),
            };
            let mut memh = null_mut();
            check(
                "ucp_mem_map",
                (self.ucp.ucp_mem_map)(self.ctx, &p, &mut memh),
            )?;
            let mut buf = null_mut();
            let mut sz = 0usize;
            let st = (self.ucp.ucp_rkey_pack)(self.ctx, memh, &mut buf, &mut sz);
            if st != UCS_OK {
                (self.ucp.ucp_mem_unmap)(self.ctx, memh);
                return Err(ffi::status_err("ucp_rkey_pack", st));
            }
            let rkey = std::slice::from_raw_parts(buf as *const u8, sz).to_vec();
            (self.ucp.ucp_rkey_buffer_release)(buf);
            Ok((memh, rkey))
        }
    }

    fn register(&mut self, l: RegionLayout) -> Result<u32> {
        l.validate()?;
        let (memh, rkey) = self.map(l.base, l.len, l.mem_type)?;
        let id = self.next_region;
        self.next_region += 1;
        self.regions.insert(
            id,
            Region {
                layout: l,
                memh,
                rkey,
                inflight: 0,
            },
        );
        Ok(id)
    }

    fn deregister(&mut self, id: u32) -> Result<()> {
        match self.regions.get(&id) {
            None => Err(PdgateError::NotFound(format!("region {id}"))),
            Some(r) if r.inflight > 0 => Err(PdgateError::InvalidArgument(format!(
                "region {id} has {} transfers in flight",
                r.inflight
            ))),
            Some(_) => {
                let r = self.regions.remove(&id).unwrap();
                check("ucp_mem_unmap", unsafe {
                    (self.ucp.ucp_mem_unmap)(self.ctx, r.memh)
                })
            }
        }
    }

    fn metadata(&self) -> Vec<u8> {
        let l = self.shared.leases.lock();
        let mut regions: Vec<RegionDesc> = self
            .regions
            .iter()
            .map(|(&id, r)| RegionDesc {
                id,
                layout: r.layout,
                rkey: r.rkey.clone(),
            })
            .collect();
        regions.sort_by_key(|r| r.id);
        PeerMeta {
            engine_id: self.init.engine_id.clone(),
            compat_hash: self.init.compat_hash,
            worker_addr: self.address.clone(),
            lease_base: l.words.as_ptr() as u64,
            lease_slots: l.words.len() as u32,
            lease_rkey: self.lease_rkey.clone(),
            regions,
        }
        .encode()
    }

    fn handle(&mut self, cmd: Cmd) -> bool {
        // Commands that change regions or peers republish the catalog
        // before answering, so the caller's next transfer sees the change.
        match cmd {
            Cmd::Register(l, tx) => {
                let r = self.register(l);
                self.publish();
                drop(tx.send(r))
            }
            Cmd::Deregister(id, tx) => {
                let r = self.deregister(id);
                self.publish();
                drop(tx.send(r))
            }
            Cmd::Metadata(tx) => drop(tx.send(Ok(self.metadata()))),
            Cmd::AddPeer(m, tx) => {
                let r = self.add_peer(*m);
                self.publish();
                drop(tx.send(r))
            }
            Cmd::RemovePeer(id, tx) => {
                let r = if self.peers.contains_key(&id) {
                    self.drop_peer(&id, false);
                    Ok(())
                } else {
                    Err(PdgateError::NotFound(format!("peer {id:?}")))
                };
                self.publish();
                drop(tx.send(r))
            }
            Cmd::Xfer(req) => {
                let id = req.id;
                if let Err(e) = self.start_xfer(*req) {
                    self.shared.complete(id, Err(e));
                }
            }
            Cmd::Shutdown => return false,
        }
        true
    }

    /// Copy what callers plan transfers against into the shared catalog.
    pub(crate) fn publish(&self) {
        let cat = Catalog {
            regions: self.regions.iter().map(|(&id, r)| (id, r.layout)).collect(),
            peers: self
                .peers
                .iter()
                .filter(|(name, _)| !self.dead.contains_key(*name))
                .map(|(name, p)| {
                    (
                        name.clone(),
                        PeerView {
                            key: p.key,
                            regions: p.regions.iter().map(|(&id, v)| (id, v.0)).collect(),
                            lease_slots: p.lease_slots,
                        },
                    )
                })
                .collect(),
            dead: self.dead.clone(),
        };
        *self.shared.catalog.write() = cat;
    }

    pub(crate) fn drain_events(&mut self) -> bool {
        let evs = EVENTS.with(|e| std::mem::take(&mut *e.borrow_mut()));
        let any = !evs.is_empty();
        for ev in evs {
            match ev {
                Ev::Req { xfer, status } => self.on_req_done(xfer, status),
                Ev::EpErr { peer, status } => self.on_ep_error(peer, status),
                Ev::Am(b) => self.on_notify(&b),
            }
        }
        any
    }

    /// The progress loop; returns on `Shutdown` or when every handle is gone.
    pub fn run(mut self, rx: Receiver<Cmd>, mut wake_rx: UnixStream) {
        let mut efd: i32 = -1;
        unsafe { (self.ucp.ucp_worker_get_efd)(self.worker, &mut efd) };
        let spin = Duration::from_micros(300);
        let mut last_active = Instant::now();
        let mut next_lease = Instant::now();
        loop {
            let mut active = false;
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        active = true;
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(_) => return,
                }
            }
            for _ in 0..64 {
                if unsafe { (self.ucp.ucp_worker_progress)(self.worker) } == 0 {
                    break;
                }
                active = true;
            }
            active |= self.drain_events();
            let now = Instant::now();
            if now >= next_lease {
                let nxt = self.shared.leases.lock().sweep(now);
                next_lease = nxt
                    .unwrap_or(now + Duration::from_millis(50))
                    .min(now + Duration::from_millis(50));
            }
            self.check_deadlines(now);
            if !self.closing.is_empty() {
                self.reap_closing(now);
            }
            if active || !self.xfers.is_empty() {
                last_active = now;
                continue;
            }
            if now.duration_since(last_active) < spin || efd < 0 {
                std::thread::yield_now();
                continue;
            }
            // Announce the sleep, then re-check the queue: a caller queues,
            // then looks at the flag (see `Shared::wake_worker`).
            self.shared.worker_sleeping.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if !rx.is_empty() || unsafe { (self.ucp.ucp_worker_arm)(self.worker) } == UCS_ERR_BUSY {
                self.shared.worker_sleeping.store(false, Ordering::SeqCst);
                continue;
            }
            let timeout = next_lease
                .saturating_duration_since(now)
                .min(Duration::from_millis(20));
            let mut fds = [
                libc::pollfd {
                    fd: efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake_rx.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout.as_millis().max(1) as i32) };
            self.shared.worker_sleeping.store(false, Ordering::SeqCst);
            let mut sink = [0u8; 256];
            while matches!(wake_rx.read(&mut sink), Ok(n) if n > 0) {}
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Fail what is still running, close every endpoint, then wait
        // (bounded) for UCX to finish before freeing anything.
        let ids: Vec<u64> = self.xfers.keys().copied().collect();
        for id in ids {
            self.fail_xfer(id, PdgateError::Closed("engine closed".into()));
        }
        let names: Vec<String> = self.peers.keys().cloned().collect();
        for n in names {
            self.drop_peer(&n, true);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while (!self.closing.is_empty() || !self.xfers.is_empty()) && Instant::now() < deadline {
            unsafe { (self.ucp.ucp_worker_progress)(self.worker) };
            self.drain_events();
            self.reap_closing(Instant::now());
        }
        unsafe {
            for (_, r) in self.regions.drain() {
                (self.ucp.ucp_mem_unmap)(self.ctx, r.memh);
            }
            if !self.lease_memh.is_null() {
                (self.ucp.ucp_mem_unmap)(self.ctx, self.lease_memh);
            }
            (self.ucp.ucp_worker_destroy)(self.worker);
            (self.ucp.ucp_cleanup)(self.ctx);
        }
    }
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| PdgateError::InvalidArgument(format!("NUL byte in {s:?}")))
}
