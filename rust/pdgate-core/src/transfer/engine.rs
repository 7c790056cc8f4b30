//! The public handle: [`TransferEngine`]. Every method is callable from any
//! thread; none touches UCX (requests go to the progress thread over a
//! channel), so callers holding Python's GIL may release it around them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Sender};
use parking_lot::Mutex;

use super::ffi;
use super::layout::{MemType, RegionLayout};
use super::meta::{compat_hash, PeerMeta};
use super::shared::{parse_token, Notification, Shared};
use super::worker::{Cmd, Worker, WorkerInit};
use super::xfer::{plan_xfer, XferReq};
use crate::error::{PdgateError, Result};

/// How to start an engine.
#[derive(Debug, Clone, Default)]
pub struct EngineConfig {
    /// Unique name of this engine (e.g. `"prefill-0"`), sent to peers.
    pub engine_id: String,
    /// Compatibility description (block layout, dtype, block size, layer
    /// count); peers must present the same hash of it.
    pub compat: String,
    /// `libucp.so.0`, or the folder holding it; `None` = loader path.
    pub ucp_lib: Option<PathBuf>,
    /// UCX transport list (`UCX_TLS`), e.g. `"tcp"` or `"sm"`.
    pub transports: Option<String>,
    /// Extra UCX options, names without the `UCX_` prefix.
    pub ucx_options: Vec<(String, String)>,
    /// Size of the lease table (concurrent leases); 0 = 4096.
    pub lease_slots: u32,
}

/// Which blocks to move: the same block id lists apply to every region pair.
#[derive(Debug, Clone, Default)]
pub struct BlockTransfer {
    /// (local region, remote region) pairs; empty = all regions, paired in id order.
    pub pairs: Vec<(u32, u32)>,
    pub local_blocks: Vec<u64>,
    pub remote_blocks: Vec<u64>,
    /// Notification sent to the peer after completion.
    pub notify: Option<Vec<u8>>,
    /// Lease token from the owner's `grant_lease` (reads only).
    pub lease: Option<Vec<u8>>,
    /// Deadline; `None` = 30 s.
    pub timeout: Option<Duration>,
}

/// KV block transfer engine over UCX.
pub struct TransferEngine {
    engine_id: String,
    shared: Arc<Shared>,
    tx: Sender<Cmd>,
    thread: Mutex<Option<JoinHandle<()>>>,
    closed: Arc<AtomicBool>,
    listeners: Mutex<Vec<JoinHandle<()>>>,
}

const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// Most `wait` polls for a result before sleeping on the condvar (µs).
const WAIT_SPIN_MAX_US: u32 = 50;
/// Least (after a run of long waits).
const WAIT_SPIN_MIN_US: u32 = 4;
/// Consecutive waits longer than `WAIT_SPIN_MAX_US` that turn spinning down.
const LONG_WAITS_TO_BACK_OFF: u32 = 4;

impl TransferEngine {
    /// Load UCX, create the context and worker on a new progress thread.
    /// Errors: `Transport` (UCX missing or failed to start),
    /// `InvalidArgument` (bad option).
    pub fn new(cfg: EngineConfig) -> Result<Self> {
        if cfg.engine_id.is_empty() || cfg.engine_id.len() > 256 {
            return Err(PdgateError::InvalidArgument(
                "engine_id must be 1..=256 bytes".into(),
            ));
        }
        let ucp = ffi::load(cfg.ucp_lib.as_deref())?;
        let slots = if cfg.lease_slots == 0 {
            4096
        } else {
            cfg.lease_slots
        };
        let (shared, wake_rx) =
            Shared::new(slots).map_err(|e| PdgateError::Transport(format!("socketpair: {e}")))?;
        let shared = Arc::new(shared);
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let init = WorkerInit {
            engine_id: cfg.engine_id.clone(),
            compat_hash: compat_hash(&cfg.compat),
            transports: cfg.transports.clone(),
            ucx_options: cfg.ucx_options.clone(),
        };
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("pdgate-ucx-{}", cfg.engine_id))
            .spawn(move || {
                // Runs on every exit path, panics included.
                struct Exit(Arc<Shared>);
                impl Drop for Exit {
                    fn drop(&mut self) {
                        self.0.worker_exited();
                    }
                }
                let _exit = Exit(sh.clone());
                match Worker::start(ucp, sh, init) {
                    Ok(w) => {
                        let _ = ready_tx.send(Ok(()));
                        w.run(rx, wake_rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| PdgateError::Transport(format!("spawn progress thread: {e}")))?;
        match ready_rx.recv_timeout(REPLY_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => return Err(PdgateError::Timeout("UCX did not start".into())),
        }
        Ok(TransferEngine {
            engine_id: cfg.engine_id,
            shared,
            tx,
            thread: Mutex::new(Some(thread)),
            closed: Arc::new(AtomicBool::new(false)),
            listeners: Mutex::new(Vec::new()),
        })
    }

    /// This engine's id.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// Version of the loaded UCX (`"1.22.0"`).
    pub fn ucx_version(&self) -> String {
        ffi::version().unwrap_or_default()
    }

    fn call<T>(&self, make: impl FnOnce(Sender<Result<T>>) -> Cmd) -> Result<T> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(PdgateError::Closed("transfer engine closed".into()));
        }
        let (tx, rx) = bounded(1);
        self.tx
            .send(make(tx))
            .map_err(|_| PdgateError::Closed("progress thread gone".into()))?;
        self.shared.wake_worker();
        match rx.recv_timeout(REPLY_TIMEOUT) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(PdgateError::Timeout(
                "progress thread did not answer".into(),
            )),
            Err(_) => Err(PdgateError::Closed("progress thread gone".into())),
        }
    }

    /// Register `len` bytes at `base` holding blocks of `block_len` bytes
    /// every `block_stride` bytes (0 = packed), `block_count` of them (0 =
    /// as many as fit). The memory stays the caller's; it must stay valid
    /// until [`deregister`](Self::deregister). Returns the region id.
    pub fn register(
        &self,
        base: u64,
        len: u64,
        block_len: u64,
        block_stride: u64,
        block_count: u64,
        mem: MemType,
    ) -> Result<u32> {
        if base == 0 {
            return Err(PdgateError::InvalidArgument("null base address".into()));
        }
        let l = RegionLayout::new(base, len, block_len, block_stride, block_count, mem)?;
        self.call(|tx| Cmd::Register(l, tx))
    }

    /// Unregister a region. Fails (`InvalidArgument`) while transfers using
    /// it are in flight; afterwards the engine keeps no pointer into it.
    pub fn deregister(&self, region: u32) -> Result<()> {
        self.call(|tx| Cmd::Deregister(region, tx))
    }

    /// Serialized metadata for peers (worker address, regions, rkeys...).
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.call(Cmd::Metadata)
    }

    /// Validate a peer's metadata and connect to it; returns its engine id.
    /// Errors: `RejectedMetadata`, `PeerUnreachable`.
    pub fn add_peer(&self, meta: &[u8]) -> Result<String> {
        let m = PeerMeta::decode(meta)?;
        self.call(|tx| Cmd::AddPeer(Box::new(m), tx))
    }

    /// Disconnect a peer.
    pub fn remove_peer(&self, peer: &str) -> Result<()> {
        self.call(|tx| Cmd::RemovePeer(peer.to_string(), tx))
    }

    /// Plan on the caller's thread (every synchronous error comes from
    /// here), then queue the plan for the progress thread without waiting
    /// for it: the outcome arrives through `poll` / `wait`.
    fn submit(&self, peer: &str, t: BlockTransfer, write: bool) -> Result<u64> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(PdgateError::Closed("transfer engine closed".into()));
        }
        let lease = t.lease.as_deref().map(parse_token).transpose()?;
        let (peer_key, pairs, segs) = plan_xfer(
            &self.shared.catalog.read(),
            peer,
            write,
            &t.pairs,
            &t.local_blocks,
            &t.remote_blocks,
            lease,
        )?;
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let req = XferReq {
            id,
            write,
            peer: peer.to_string(),
            peer_key,
            pairs,
            segs,
            notify: t.notify,
            lease,
            timeout: t.timeout.unwrap_or(Duration::from_secs(30)),
        };
        {
            let mut c = self.shared.comp.lock();
            if c.worker_gone {
                return Err(PdgateError::Closed("transfer engine stopped".into()));
            }
            c.pending.insert(id);
        }
        if self.tx.send(Cmd::Xfer(Box::new(req))).is_err() {
            self.shared.comp.lock().pending.remove(&id);
            return Err(PdgateError::Closed("progress thread gone".into()));
        }
        self.shared.wake_worker();
        Ok(id)
    }

    /// Pull blocks from `peer` into local regions. Returns a transfer id
    /// whose outcome comes from [`poll`](Self::poll) / [`wait`](Self::wait).
    /// Synchronous errors (nothing posted): `NotFound`, `OutOfRange`,
    /// `InvalidArgument`, `PeerUnreachable`. The transfer is planned and
    /// checked on the calling thread and queued without waiting for the
    /// progress thread; a peer or region removed concurrently (by another
    /// thread) before it is posted makes it fail later with `NotFound`.
    pub fn read_blocks(&self, peer: &str, t: BlockTransfer) -> Result<u64> {
        self.submit(peer, t, false)
    }

    /// Push local blocks into `peer`'s regions (remote completion is
    /// guaranteed by an endpoint flush before success is reported).
    pub fn write_blocks(&self, peer: &str, t: BlockTransfer) -> Result<u64> {
        self.submit(peer, t, true)
    }

    /// Finished transfers since the last call: (succeeded ids, failed ids with errors).
    pub fn poll(&self) -> (Vec<u64>, Vec<(u64, PdgateError)>) {
        let mut c = self.shared.comp.lock();
        let order = std::mem::take(&mut c.order);
        let (mut ok, mut bad) = (Vec::new(), Vec::new());
        for id in order {
            match c.results.remove(&id) {
                Some(Ok(())) => ok.push(id),
                Some(Err(e)) => bad.push((id, e)),
                None => {}
            }
        }
        (ok, bad)
    }

    /// Block until transfer `id` finishes (or `timeout` passes: `Timeout`),
    /// returning its outcome. `NotFound` if it was already collected.
    pub fn wait(&self, id: u64, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        // Spin (bounded) before sleeping: a short transfer finishes in less
        // time than a condvar sleep + wake-up costs. Only while waits are
        // short: after a few waits in a row longer than the spin limit (long
        // transfers, e.g. tcp), the next ones barely spin, since a spinning
        // waiter would only take CPU from the progress threads.
        let long = self.shared.long_waits.load(Ordering::Relaxed);
        let budget = if long >= LONG_WAITS_TO_BACK_OFF {
            WAIT_SPIN_MIN_US
        } else {
            WAIT_SPIN_MAX_US
        };
        let spin_end =
            start + Duration::from_micros(budget as u64).min(timeout.unwrap_or(Duration::MAX));
        let mut waited = false;
        let r = 'outer: loop {
            let seq = self.shared.done_seq.load(Ordering::Acquire);
            {
                let mut c = self.shared.comp.lock();
                if let Some(r) = c.results.remove(&id) {
                    break r;
                }
                if !c.pending.contains(&id) {
                    return Err(PdgateError::NotFound(format!(
                        "transfer {id} (unknown or already collected)"
                    )));
                }
            }
            waited = true;
            // Until something new is published or the budget runs out.
            let mut spins = 0u32;
            while self.shared.done_seq.load(Ordering::Acquire) == seq {
                spins += 1;
                if spins & 63 == 0 {
                    if Instant::now() >= spin_end {
                        break 'outer self.wait_blocking(id, deadline);
                    }
                    // Let the progress thread run if it shares our core.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        };
        if waited {
            // A run of long waits (not one preempted wait) turns spinning down.
            let next = if start.elapsed() <= Duration::from_micros(WAIT_SPIN_MAX_US as u64) {
                0
            } else {
                long.saturating_add(1).min(LONG_WAITS_TO_BACK_OFF)
            };
            if next != long {
                self.shared.long_waits.store(next, Ordering::Relaxed);
            }
        }
        r
    }

    fn wait_blocking(&self, id: u64, deadline: Option<Instant>) -> Result<()> {
        let mut c = self.shared.comp.lock();
        loop {
            if let Some(r) = c.results.remove(&id) {
                return r;
            }
            if !c.pending.contains(&id) {
                return Err(PdgateError::NotFound(format!(
                    "transfer {id} (unknown or already collected)"
                )));
            }
            match deadline {
                Some(d) => {
                    if self.shared.comp_cv.wait_until(&mut c, d).timed_out()
                        && !c.results.contains_key(&id)
                    {
                        return Err(PdgateError::Timeout(format!("transfer {id} still running")));
                    }
                }
                None => self.shared.comp_cv.wait(&mut c),
            }
        }
    }

    /// Notifications received since the last call.
    pub fn get_notifications(&self) -> Vec<Notification> {
        self.shared.notifs.lock().drain(..).collect()
    }

    /// Owner side: pin blocks for `request_id` for `ttl`; returns the lease
    /// token to hand to the reader (it passes it to `read_blocks`).
    pub fn grant_lease(&self, request_id: &str, ttl: Duration) -> Result<Vec<u8>> {
        let t = self.shared.leases.lock().grant(request_id, ttl)?;
        self.shared.wake_worker();
        Ok(t)
    }

    /// Owner side: drop a lease now (reads holding it then fail). True if held.
    pub fn release_lease(&self, request_id: &str) -> bool {
        self.shared.leases.lock().release(request_id)
    }

    /// Owner side: request ids whose lease expired since the last call; their
    /// blocks may be freed (late readers get `LeaseExpired`).
    pub fn expired_leases(&self) -> Vec<String> {
        std::mem::take(&mut self.shared.leases.lock().expired)
    }

    /// File descriptor that becomes readable when results or notifications
    /// arrive (drain it with [`drain_event_fd`](Self::drain_event_fd)).
    pub fn event_fd(&self) -> RawFd {
        self.shared.event_rx.as_raw_fd()
    }

    /// Empty the event fd.
    /// Collect with [`poll`](Self::poll) / [`get_notifications`](Self::get_notifications)
    /// after draining: the fd becomes readable again only for what is
    /// published after the drain.
    pub fn drain_event_fd(&self) {
        self.shared.drain_event();
    }

    /// Serve this engine's metadata over TCP at `addr` (port 0 = any); each
    /// connection gets `u32 LE length || metadata`. Returns the bound address.
    pub fn listen(self: &Arc<Self>, addr: &str) -> Result<SocketAddr> {
        let l = TcpListener::bind(addr)
            .map_err(|e| PdgateError::InvalidArgument(format!("bind {addr}: {e}")))?;
        let local = l
            .local_addr()
            .map_err(|e| PdgateError::Transport(e.to_string()))?;
        l.set_nonblocking(true)
            .map_err(|e| PdgateError::Transport(e.to_string()))?;
        let weak = Arc::downgrade(self);
        let closed = self.closed.clone();
        let h = std::thread::spawn(move || loop {
            if closed.load(Ordering::SeqCst) {
                return;
            }
            match l.accept() {
                Ok((mut s, _)) => {
                    let Some(eng) = weak.upgrade() else { return };
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                    if let Ok(m) = eng.metadata() {
                        let _ = s
                            .write_all(&(m.len() as u32).to_le_bytes())
                            .and_then(|_| s.write_all(&m));
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        });
        self.listeners.lock().push(h);
        Ok(local)
    }

    /// Stop the progress thread (fails running transfers with `Closed`,
    /// closes endpoints, unregisters all regions). Idempotent.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.tx.send(Cmd::Shutdown);
        self.shared.wake_worker();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        for h in self.listeners.lock().drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.close();
    }
}

/// Fetch a peer's metadata from its [`TransferEngine::listen`] address.
/// Errors: `PeerUnreachable` (refused, unresolvable), `Timeout`,
/// `RejectedMetadata` (bad framing).
pub fn fetch_metadata(addr: &str, timeout: Duration) -> Result<Vec<u8>> {
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| PdgateError::PeerUnreachable(format!("{addr}: {e}")))?
        .next()
        .ok_or_else(|| PdgateError::PeerUnreachable(format!("{addr}: no address")))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout).map_err(|e| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            PdgateError::Timeout(format!("connect {addr}: {e}"))
        } else {
            PdgateError::PeerUnreachable(format!("connect {addr}: {e}"))
        }
    })?;
    s.set_read_timeout(Some(timeout)).ok();
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            PdgateError::Timeout(format!("read {addr}: {e}"))
        }
        std::io::ErrorKind::UnexpectedEof => {
            PdgateError::RejectedMetadata(format!("{addr} closed mid-message"))
        }
        _ => PdgateError::PeerUnreachable(format!("read {addr}: {e}")),
    };
    let mut n = [0u8; 4];
    s.read_exact(&mut n).map_err(io)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > 64 << 20 {
        return Err(PdgateError::RejectedMetadata(format!(
            "{n}-byte metadata from {addr}"
        )));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).map_err(io)?;
    Ok(b)
}
