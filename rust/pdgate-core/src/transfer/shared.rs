//! State shared between the engine handle (any thread) and the progress
//! thread: completed transfers, received notifications, the lease table and
//! the wake-up sockets. No UCX call happens here.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::layout::RegionLayout;
use crate::error::{PdgateError, Result};

/// A notification received from a peer (an active message), e.g. "request
/// `r` finished reading its blocks, free them".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Engine id of the sender.
    pub peer: String,
    /// Payload bytes as the sender passed them to `notify=`.
    pub msg: Vec<u8>,
    /// Request id of the lease this notification released, if any.
    pub released_lease: Option<String>,
}

#[derive(Default)]
pub(crate) struct Completions {
    pub results: HashMap<u64, Result<()>>,
    pub order: VecDeque<u64>,
    /// Submitted, not yet finished.
    pub pending: std::collections::HashSet<u64>,
    /// False once the progress thread has exited.
    pub worker_gone: bool,
}

/// Owner-side leases. A lease pins blocks for one request until the reader
/// notifies or the time-to-live passes. Each lease owns a slot in a
/// registered table of u64 words holding the lease's epoch (0 = free);
/// readers GET the word after their data GETs and fail with `LeaseExpired`
/// when it no longer holds the epoch they were granted.
pub(crate) struct Leases {
    pub words: Box<[AtomicU64]>,
    free: Vec<u32>,
    by_req: HashMap<String, (u32, u64, Instant)>,
    next_epoch: u64,
    pub expired: Vec<String>,
}

impl Leases {
    pub fn new(slots: u32) -> Self {
        Leases {
            words: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            free: (0..slots).rev().collect(),
            by_req: HashMap::new(),
            next_epoch: 1,
            expired: Vec::new(),
        }
    }

    /// Grant a lease; returns the token `slot u32 LE || epoch u64 LE`.
    pub fn grant(&mut self, req: &str, ttl: Duration) -> Result<Vec<u8>> {
        if self.by_req.contains_key(req) {
            return Err(PdgateError::InvalidArgument(format!(
                "lease for {req:?} already held"
            )));
        }
        let slot = self
            .free
            .pop()
            .ok_or_else(|| PdgateError::InvalidArgument("lease table full".into()))?;
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        self.words[slot as usize].store(epoch, Ordering::SeqCst);
        self.by_req
            .insert(req.to_string(), (slot, epoch, Instant::now() + ttl));
        let mut t = slot.to_le_bytes().to_vec();
        t.extend_from_slice(&epoch.to_le_bytes());
        Ok(t)
    }

    fn drop_slot(&mut self, slot: u32) {
        // Clear the word before anyone may reuse the blocks.
        self.words[slot as usize].store(0, Ordering::SeqCst);
        self.free.push(slot);
    }

    /// Release by request id; true if it was held.
    pub fn release(&mut self, req: &str) -> bool {
        match self.by_req.remove(req) {
            Some((slot, _, _)) => {
                self.drop_slot(slot);
                true
            }
            None => false,
        }
    }

    /// Release by (slot, epoch) from a reader's notification; returns the
    /// request id if that lease was still live.
    pub fn release_token(&mut self, slot: u32, epoch: u64) -> Option<String> {
        let req = self
            .by_req
            .iter()
            .find(|(_, &(s, e, _))| s == slot && e == epoch)
            .map(|(k, _)| k.clone())?;
        self.release(&req);
        Some(req)
    }

    /// Expire overdue leases (their words are cleared first); returns the
    /// earliest remaining deadline.
    pub fn sweep(&mut self, now: Instant) -> Option<Instant> {
        let due: Vec<String> = self
            .by_req
            .iter()
            .filter(|(_, v)| v.2 <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for r in due {
            self.release(&r);
            self.expired.push(r);
        }
        self.by_req.values().map(|v| v.2).min()
    }
}

/// Parse a lease token.
pub fn parse_token(t: &[u8]) -> Result<(u32, u64)> {
    if t.len() != 12 {
        return Err(PdgateError::InvalidArgument(
            "lease token must be 12 bytes".into(),
        ));
    }
    Ok((
        u32::from_le_bytes(t[..4].try_into().unwrap()),
        u64::from_le_bytes(t[4..].try_into().unwrap()),
    ))
}

/// A peer as callers see it (for planning transfers on their own thread).
#[derive(Clone)]
pub(crate) struct PeerView {
    /// Changes when the peer is re-added: a plan made against an older
    /// view is refused by the progress thread.
    pub key: u64,
    pub regions: HashMap<u32, RegionLayout>,
    pub lease_slots: u32,
}

/// What callers need to validate and plan a transfer without a round trip
/// to the progress thread. Only the progress thread writes it, before it
/// answers the command that changed it (so a caller sees its own
/// register / add_peer / remove_peer), and when a peer fails.
#[derive(Default)]
pub(crate) struct Catalog {
    pub regions: HashMap<u32, RegionLayout>,
    pub peers: HashMap<String, PeerView>,
    /// Peers whose endpoint failed, with the reason (until re-added).
    pub dead: HashMap<String, PdgateError>,
}

pub(crate) struct Shared {
    pub catalog: RwLock<Catalog>,
    pub comp: Mutex<Completions>,
    pub comp_cv: Condvar,
    pub notifs: Mutex<VecDeque<Notification>>,
    pub leases: Mutex<Leases>,
    /// Written by the progress thread when results or notifications arrive
    /// (asyncio watches the read end).
    pub event_tx: UnixStream,
    pub event_rx: UnixStream,
    /// Written by callers to wake the progress thread.
    pub wake_tx: UnixStream,
    pub next_id: AtomicU64,
    /// Bumped on every published result (lets `wait` spin on one word).
    pub done_seq: AtomicU64,
    /// The event socket holds an unread byte (set by the writer, cleared by
    /// `drain_event`): one write per drain, not one per result.
    pub event_armed: AtomicBool,
    /// The progress thread is (about to be) asleep in `poll`: only then do
    /// callers write the wake socket.
    pub worker_sleeping: AtomicBool,
    /// Consecutive `wait`s that outlasted their spin (capped): decides
    /// how long the next one spins.
    pub long_waits: AtomicU32,
}

impl Shared {
    pub fn new(lease_slots: u32) -> std::io::Result<(Self, UnixStream)> {
        let (event_tx, event_rx) = UnixStream::pair()?;
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        for s in [&event_tx, &event_rx, &wake_tx, &wake_rx] {
            s.set_nonblocking(true)?;
        }
        Ok((
            Shared {
                catalog: RwLock::new(Catalog::default()),
                comp: Mutex::new(Completions::default()),
                comp_cv: Condvar::new(),
                notifs: Mutex::new(VecDeque::new()),
                leases: Mutex::new(Leases::new(lease_slots)),
                event_tx,
                event_rx,
                wake_tx,
                next_id: AtomicU64::new(1),
                done_seq: AtomicU64::new(0),
                event_armed: AtomicBool::new(false),
                worker_sleeping: AtomicBool::new(false),
                long_waits: AtomicU32::new(0),
            },
            wake_rx,
        ))
    }

    /// Called when the progress thread ends (normally or by panic): fail
    /// whatever is still pending so no waiter blocks forever.
    pub fn worker_exited(&self) {
        let mut c = self.comp.lock();
        c.worker_gone = true;
        let left: Vec<u64> = c.pending.drain().collect();
        for id in left {
            c.results.insert(
                id,
                Err(PdgateError::Closed("transfer engine stopped".into())),
            );
            c.order.push_back(id);
        }
        drop(c);
        self.done_seq.fetch_add(1, Ordering::SeqCst);
        self.comp_cv.notify_all();
        self.event_armed.store(false, Ordering::SeqCst);
        self.signal_event();
    }

    /// Make the event socket readable unless it already is (a byte written
    /// since the last `drain_event`).
    pub fn signal_event(&self) {
        if !self.event_armed.swap(true, Ordering::AcqRel) {
            let _ = (&self.event_tx).write(&[1]);
        }
    }

    /// Empty the event socket. Callers then collect results and
    /// notifications: anything published after the drain either sees the
    /// flag cleared (and writes again) or is visible to that collection
    /// (the swap below reads the publisher's swap).
    pub fn drain_event(&self) {
        let mut b = [0u8; 256];
        while matches!((&self.event_rx).read(&mut b), Ok(n) if n > 0) {}
        self.event_armed.swap(false, Ordering::AcqRel);
    }

    /// Wake the progress thread after queueing a command. It only needs
    /// waking when asleep: it sets `worker_sleeping`, then re-checks its
    /// queue before sleeping, and we check the flag after queueing
    /// (both sides fenced), so one of us always sees the other.
    pub fn wake_worker(&self) {
        fence(Ordering::SeqCst);
        if self.worker_sleeping.load(Ordering::SeqCst) {
            let _ = (&self.wake_tx).write(&[1]);
        }
    }

    /// Record a finished transfer and wake waiters.
    pub fn complete(&self, id: u64, r: Result<()>) {
        {
            let mut c = self.comp.lock();
            if !c.pending.remove(&id) {
                return;
            }
            c.results.insert(id, r);
            c.order.push_back(id);
        }
        self.done_seq.fetch_add(1, Ordering::Release);
        self.comp_cv.notify_all();
        self.signal_event();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_lifecycle() {
        let mut l = Leases::new(2);
        let t = l.grant("a", Duration::from_secs(60)).unwrap();
        let (slot, epoch) = parse_token(&t).unwrap();
        assert_eq!(l.words[slot as usize].load(Ordering::SeqCst), epoch);
        assert!(l.grant("a", Duration::from_secs(1)).is_err());
        l.grant("b", Duration::ZERO).unwrap();
        assert!(l.grant("c", Duration::from_secs(1)).is_err(), "table full");
        l.sweep(Instant::now() + Duration::from_millis(1));
        assert_eq!(l.expired, vec!["b".to_string()]);
        assert_eq!(l.release_token(slot, epoch + 1), None);
        assert_eq!(l.release_token(slot, epoch).as_deref(), Some("a"));
        assert_eq!(l.words[slot as usize].load(Ordering::SeqCst), 0);
        let t2 = l.grant("d", Duration::from_secs(1)).unwrap();
        assert_ne!(parse_token(&t2).unwrap().1, epoch, "epochs never repeat");
    }
}
