//! Bindings for the KV block transfer engine: `pdgate._native.TransferEngine`.
//!
//! Every call into the core runs inside `py.allow_threads`: no UCX work
//! (and no wait on the progress thread) ever happens under the GIL.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pdgate_core::transfer::{self as core, BlockTransfer, EngineConfig, MemType};
use pdgate_core::PdgateError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::to_py;

#[derive(FromPyObject)]
enum BytesLike {
    #[pyo3(transparent, annotation = "bytes")]
    Bytes(Vec<u8>),
    #[pyo3(transparent, annotation = "str")]
    Str(String),
}

impl BytesLike {
    fn into_vec(self) -> Vec<u8> {
        match self {
            BytesLike::Bytes(b) => b,
            BytesLike::Str(s) => s.into_bytes(),
        }
    }
}

fn secs(name: &str, s: f64) -> PyResult<Duration> {
    if !s.is_finite() || s < 0.0 {
        return Err(to_py(PdgateError::InvalidArgument(format!(
            "{name} must be a finite number of seconds >= 0"
        ))));
    }
    Ok(Duration::from_secs_f64(s))
}

/// KV block transfer engine over UCX (one-sided GET/PUT, zero-copy).
///
/// TransferEngine(engine_id, compat="", *, ucp_lib=None, transports=None,
///                ucx_options=None, lease_slots=4096)
///
/// Moves KV cache blocks between registered memory regions of two engines
/// (a prefill instance's and a decode instance's). A dedicated progress
/// thread owns the UCX worker; no method does UCX work under the GIL.
/// Most callers use `pdgate.transfer.create_engine`, which finds UCX in the
/// `libucx-cu12` wheel.
///
/// Args:
///     engine_id: unique name sent to peers (1..256 bytes).
///     compat: KV layout description (block layout, dtype, block size,
///         layer count); peers must present the same description's hash.
///     ucp_lib: path to `libucp.so.0` or its folder; None = loader path.
///     transports: UCX transport list (UCX_TLS), e.g. "tcp" or "sm".
///     ucx_options: extra UCX settings, names without the `UCX_` prefix.
///     lease_slots: capacity of the lease table (concurrent leases).
///
/// Raises:
///     TransportError: UCX could not be loaded or started.
///     InvalidArgumentError: bad engine_id or UCX option.
#[pyclass(module = "pdgate._native", name = "TransferEngine", frozen)]
pub struct PyTransferEngine {
    inner: Arc<core::TransferEngine>,
}

fn transfer(
    local_blocks: Vec<u64>,
    remote_blocks: Vec<u64>,
    regions: Option<Vec<u32>>,
    remote_regions: Option<Vec<u32>>,
    notify: Option<BytesLike>,
    lease: Option<Vec<u8>>,
    timeout_s: f64,
) -> PyResult<BlockTransfer> {
    let pairs = match (regions, remote_regions) {
        (None, None) => Vec::new(),
        (Some(l), None) => l.iter().map(|&r| (r, r)).collect(),
        (Some(l), Some(r)) if l.len() == r.len() => l.into_iter().zip(r).collect(),
        _ => {
            return Err(to_py(PdgateError::InvalidArgument(
                "regions and remote_regions must have equal lengths (remote_regions alone is not allowed)".into(),
            )))
        }
    };
    Ok(BlockTransfer {
        pairs,
        local_blocks,
        remote_blocks,
        notify: notify.map(BytesLike::into_vec),
        lease,
        timeout: Some(secs("timeout_s", timeout_s)?),
    })
}

#[pymethods]
impl PyTransferEngine {
    #[new]
    #[pyo3(signature = (engine_id, compat = "", *, ucp_lib = None, transports = None, ucx_options = None, lease_slots = 4096))]
    fn new(
        py: Python<'_>,
        engine_id: &str,
        compat: &str,
        ucp_lib: Option<PathBuf>,
        transports: Option<String>,
        ucx_options: Option<std::collections::HashMap<String, String>>,
        lease_slots: u32,
    ) -> PyResult<Self> {
        let cfg = EngineConfig {
            engine_id: engine_id.to_string(),
            compat: compat.to_string(),
            ucp_lib,
            transports,
            ucx_options: ucx_options
                .map(|m| m.into_iter().collect())
                .unwrap_or_default(),
            lease_slots,
        };
        let e = py
            .allow_threads(|| core::TransferEngine::new(cfg))
            .map_err(to_py)?;
        Ok(Self { inner: Arc::new(e) })
    }

    /// This engine's id.
    #[getter]
    fn engine_id(&self) -> String {
        self.inner.engine_id().to_string()
    }

    /// Version of the loaded UCX library, e.g. "1.22.0".
    #[getter]
    fn ucx_version(&self) -> String {
        self.inner.ucx_version()
    }

    /// Register caller-owned memory holding KV blocks; returns the region id.
    ///
    /// Args:
    ///     addr: start address (int, e.g. `tensor.data_ptr()`).
    ///     length: bytes registered.
    ///     block_len: bytes per block.
    ///     block_stride: bytes between block starts (0 = block_len).
    ///     block_count: number of blocks (0 = as many as fit).
    ///     mem_type: "host" or "cuda".
    ///
    /// The memory must stay alive until `deregister`.
    ///
    /// Raises:
    ///     InvalidArgumentError: inconsistent geometry or null address.
    ///     TransportError: UCX refused the registration.
    #[pyo3(signature = (addr, length, block_len, block_stride = 0, block_count = 0, mem_type = "host"))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        block_len: u64,
        block_stride: u64,
        block_count: u64,
        mem_type: &str,
    ) -> PyResult<u32> {
        let mt = MemType::parse(mem_type).map_err(to_py)?;
        py.allow_threads(|| {
            self.inner
                .register(addr, length, block_len, block_stride, block_count, mt)
        })
        .map_err(to_py)
    }

    /// Unregister a region; afterwards the engine holds no pointer into it.
    ///
    /// Raises:
    ///     NotFoundError: unknown region.
    ///     InvalidArgumentError: transfers using the region are in flight.
    fn deregister(&self, py: Python<'_>, region: u32) -> PyResult<()> {
        py.allow_threads(|| self.inner.deregister(region))
            .map_err(to_py)
    }

    /// Serialized metadata (worker address, regions, rkeys, lease table) to
    /// give to peers.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let m = py.allow_threads(|| self.inner.metadata()).map_err(to_py)?;
        Ok(PyBytes::new(py, &m))
    }

    /// Validate a peer's metadata and connect; returns the peer's engine id.
    ///
    /// Raises:
    ///     RejectedMetadataError: corrupted, truncated, other protocol
    ///         version, or incompatible KV layout.
    ///     PeerUnreachableError: no UCX transport reaches the peer.
    fn add_peer(&self, py: Python<'_>, metadata: Vec<u8>) -> PyResult<String> {
        py.allow_threads(|| self.inner.add_peer(&metadata))
            .map_err(to_py)
    }

    /// Fetch a peer's metadata from its `listen` address ("host:port") and
    /// add it; returns its engine id.
    ///
    /// Raises:
    ///     PeerUnreachableError: nothing listens there.
    ///     TransferTimeoutError: no answer within timeout_s seconds.
    ///     RejectedMetadataError: see add_peer.
    #[pyo3(signature = (addr, timeout_s = 5.0))]
    fn connect(&self, py: Python<'_>, addr: &str, timeout_s: f64) -> PyResult<String> {
        let t = secs("timeout_s", timeout_s)?;
        py.allow_threads(|| {
            let m = core::fetch_metadata(addr, t)?;
            self.inner.add_peer(&m)
        })
        .map_err(to_py)
    }

    /// Disconnect a peer.
    fn remove_peer(&self, py: Python<'_>, peer: &str) -> PyResult<()> {
        py.allow_threads(|| self.inner.remove_peer(peer))
            .map_err(to_py)
    }

    /// Pull blocks from `peer` into local regions; returns a transfer id.
    ///
    /// `local_blocks[i]` receives the peer's `remote_blocks[i]`, in every
    /// region pair: `regions[j]` (local) with `remote_regions[j]` (peer);
    /// by default all regions, paired in id order (one per layer, say).
    /// Adjacent blocks are coalesced; all operations are posted at once.
    /// `notify` (bytes/str) is delivered to the peer after the data landed;
    /// `lease` (token from the owner's `grant_lease`) makes the read fail
    /// with LeaseExpiredError if the lease ended before the read finished.
    ///
    /// Raises (nothing posted):
    ///     BlockOutOfRangeError: a block id outside its region.
    ///     NotFoundError: unknown peer or region.
    ///     PeerUnreachableError: the peer's endpoint failed earlier.
    ///     InvalidArgumentError: mismatched lists or block lengths.
    /// Later failures arrive through `poll`/`wait`.
    #[pyo3(signature = (peer, local_blocks, remote_blocks, *, regions = None, remote_regions = None, notify = None, lease = None, timeout_s = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn read_blocks(
        &self,
        py: Python<'_>,
        peer: &str,
        local_blocks: Vec<u64>,
        remote_blocks: Vec<u64>,
        regions: Option<Vec<u32>>,
        remote_regions: Option<Vec<u32>>,
        notify: Option<BytesLike>,
        lease: Option<Vec<u8>>,
        timeout_s: f64,
    ) -> PyResult<u64> {
        let t = transfer(
            local_blocks,
            remote_blocks,
            regions,
            remote_regions,
            notify,
            lease,
            timeout_s,
        )?;
        py.allow_threads(|| self.inner.read_blocks(peer, t))
            .map_err(to_py)
    }

    /// Push local blocks into `peer`'s regions; returns a transfer id.
    /// Same arguments as `read_blocks` except `lease`. Success is reported
    /// after an endpoint flush (the bytes are in the peer's memory).
    #[pyo3(signature = (peer, local_blocks, remote_blocks, *, regions = None, remote_regions = None, notify = None, timeout_s = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn write_blocks(
        &self,
        py: Python<'_>,
        peer: &str,
        local_blocks: Vec<u64>,
        remote_blocks: Vec<u64>,
        regions: Option<Vec<u32>>,
        remote_regions: Option<Vec<u32>>,
        notify: Option<BytesLike>,
        timeout_s: f64,
    ) -> PyResult<u64> {
        let t = transfer(
            local_blocks,
            remote_blocks,
            regions,
            remote_regions,
            notify,
            None,
            timeout_s,
        )?;
        py.allow_threads(|| self.inner.write_blocks(peer, t))
            .map_err(to_py)
    }

    /// Transfers finished since the last call: `(done_ids, [(id, exc), ...])`
    /// where `exc` is the PdgateError subclass instance describing the failure.
    fn poll(&self, py: Python<'_>) -> (Vec<u64>, Vec<(u64, PyObject)>) {
        let (ok, bad) = py.allow_threads(|| self.inner.poll());
        let bad = bad
            .into_iter()
            .map(|(id, e)| (id, to_py(e).into_value(py).into_any()))
            .collect();
        (ok, bad)
    }

    /// Block (GIL released) until transfer `xfer_id` finishes.
    ///
    /// Raises: the transfer's error (PeerUnreachableError,
    /// LeaseExpiredError, TransferTimeoutError, TransportError...);
    /// TransferTimeoutError if still running after timeout_s seconds;
    /// NotFoundError if already collected by `poll`.
    #[pyo3(signature = (xfer_id, timeout_s = None))]
    fn wait(&self, py: Python<'_>, xfer_id: u64, timeout_s: Option<f64>) -> PyResult<()> {
        let t = timeout_s.map(|s| secs("timeout_s", s)).transpose()?;
        py.allow_threads(|| self.inner.wait(xfer_id, t))
            .map_err(to_py)
    }

    /// Notifications received since the last call, as dicts with keys
    /// `peer` (str), `msg` (bytes), `released_lease` (str | None).
    fn get_notifications<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let v = py.allow_threads(|| self.inner.get_notifications());
        v.into_iter()
            .map(|n| {
                let d = PyDict::new(py);
                d.set_item("peer", n.peer)?;
                d.set_item("msg", PyBytes::new(py, &n.msg))?;
                d.set_item("released_lease", n.released_lease)?;
                Ok(d)
            })
            .collect()
    }

    /// Owner side: pin a request's blocks for `ttl_s` seconds; returns the
    /// lease token (bytes) to send to the reader with the block ids.
    ///
    /// Raises:
    ///     InvalidArgumentError: the request already holds a lease, or the
    ///         table is full.
    fn grant_lease<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        ttl_s: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let ttl = secs("ttl_s", ttl_s)?;
        let t = py
            .allow_threads(|| self.inner.grant_lease(request_id, ttl))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &t))
    }

    /// Owner side: end a lease now; True if it was held.
    fn release_lease(&self, py: Python<'_>, request_id: &str) -> bool {
        py.allow_threads(|| self.inner.release_lease(request_id))
    }

    /// Owner side: request ids whose leases expired since the last call
    /// (free their blocks; late reads fail with LeaseExpiredError).
    fn expired_leases(&self, py: Python<'_>) -> Vec<String> {
        py.allow_threads(|| self.inner.expired_leases())
    }

    /// Serve this engine's metadata over TCP; returns the bound port.
    #[pyo3(signature = (host = "127.0.0.1", port = 0))]
    fn listen(&self, py: Python<'_>, host: &str, port: u16) -> PyResult<u16> {
        let addr = format!("{host}:{port}");
        py.allow_threads(|| self.inner.listen(&addr))
            .map(|a| a.port())
            .map_err(to_py)
    }

    /// File descriptor that becomes readable when transfers finish or
    /// notifications arrive (for event loops); see `drain_event_fd`.
    fn event_fd(&self) -> i32 {
        self.inner.event_fd()
    }

    /// Empty the event fd (call before `poll`).
    fn drain_event_fd(&self) {
        self.inner.drain_event_fd()
    }

    /// Stop the engine: running transfers fail with ClosedError, endpoints
    /// close, regions are unregistered. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| self.inner.close())
    }
}

/// Fetch a peer's metadata from its `TransferEngine.listen` address
/// ("host:port") within `timeout_s` seconds.
///
/// Raises:
///     PeerUnreachableError: connection refused / no such host.
///     TransferTimeoutError: no answer in time.
///     RejectedMetadataError: malformed framing.
#[pyfunction]
#[pyo3(signature = (addr, timeout_s = 5.0))]
fn fetch_metadata<'py>(
    py: Python<'py>,
    addr: &str,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = secs("timeout_s", timeout_s)?;
    let b = py
        .allow_threads(|| core::fetch_metadata(addr, t))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &b))
}

/// 64-bit hash of a KV layout description, as engines compare it.
#[pyfunction]
fn compat_hash(desc: &str) -> u64 {
    core::compat_hash(desc)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTransferEngine>()?;
    m.add_function(wrap_pyfunction!(fetch_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(compat_hash, m)?)?;
    Ok(())
}
