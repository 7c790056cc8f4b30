//! Hand-written FFI for the handful of UCP calls the engine uses (UCX 1.22 API).
//!
//! Nothing here is needed at build time: `libucp.so` is `dlopen`ed at run
//! time (from the `libucx-cu12` wheel's `lib/` folder, or the loader path),
//! so neither the build nor the wheel depends on a system UCX.
//!
//! Struct layouts were checked against the 1.22 headers with a C probe
//! (`sizeof`/`offsetof`); the `const` asserts below pin the sizes.
#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::Path;
use std::sync::OnceLock;

use crate::error::{PdgateError, Result};

pub type ucs_status_t = c_int;
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_config_t = c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_mem_h = *mut c_void;
pub type ucp_rkey_h = *mut c_void;
pub type ucp_address_t = c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
pub const UCS_ERR_LAST: isize = -100;

/// UCP API version the declarations follow (`UCP_API_MAJOR/MINOR`).
pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 22;

// ucp_params_t.field_mask / features
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;
// ucp_worker_params_t
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
// ucp_worker_attr_t
pub const UCP_WORKER_ATTR_FIELD_ADDRESS: u64 = 1 << 1;
// ucp_ep_params_t
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
// ucp_mem_map_params_t
pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub const UCS_MEMORY_TYPE_CUDA: c_int = 1;
// ucp_request_param_t.op_attr_mask
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;
// ucp_am_handler_param_t
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
pub const UCP_AM_SEND_FLAG_COPY_HEADER: u32 = 1 << 3;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

pub type SendCb =
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void);
pub type ErrCb = unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t);
pub type AmRecvCb = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t;

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
    pub node_local_id: usize,
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

#[repr(C)]
pub struct ucp_worker_attr_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub address_flags: u32,
    pub address: *mut ucp_address_t,
    pub address_length: usize,
    pub max_am_header: usize,
    pub name: [c_char; 32],
    pub max_debug_string: usize,
}

#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler_cb: Option<ErrCb>,
    pub err_handler_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
    pub exported_memh_buffer: *const c_void,
}

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: Option<SendCb>,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: ucp_mem_h,
    pub remote_datatype: u64,
    pub remote: *const c_void,
    pub remote_count: usize,
}

#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: Option<AmRecvCb>,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ucp_params_t>() == 88);
    assert!(offset_of!(ucp_params_t, name) == 72);
    assert!(size_of::<ucp_worker_params_t>() == 200);
    assert!(offset_of!(ucp_worker_params_t, events) == 144);
    assert!(offset_of!(ucp_worker_params_t, client_id) == 192);
    assert!(size_of::<ucp_worker_attr_t>() == 80);
    assert!(offset_of!(ucp_worker_attr_t, address_length) == 24);
    assert!(offset_of!(ucp_worker_attr_t, max_debug_string) == 72);
    assert!(size_of::<ucp_ep_params_t>() == 104);
    assert!(offset_of!(ucp_ep_params_t, err_handler_cb) == 24);
    assert!(offset_of!(ucp_ep_params_t, flags) == 48);
    assert!(offset_of!(ucp_ep_params_t, sockaddr) == 56);
    assert!(offset_of!(ucp_ep_params_t, local_sockaddr) == 88);
    assert!(size_of::<ucp_mem_map_params_t>() == 48);
    assert!(offset_of!(ucp_mem_map_params_t, memory_type) == 32);
    assert!(size_of::<ucp_request_param_t>() == 96);
    assert!(offset_of!(ucp_request_param_t, memory_type) == 48);
    assert!(offset_of!(ucp_request_param_t, memh) == 64);
    assert!(offset_of!(ucp_request_param_t, remote_count) == 88);
    assert!(size_of::<ucp_am_handler_param_t>() == 32);
    assert!(offset_of!(ucp_am_handler_param_t, cb) == 16);
    assert!(size_of::<ucp_am_recv_param_t>() == 16);
};

macro_rules! ucp_fns {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// Function table resolved from `libucp.so` (and its `libucs` dependency).
        pub struct Ucp {
            _lib: libloading::Library,
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }
        impl Ucp {
            unsafe fn resolve(lib: libloading::Library) -> std::result::Result<Self, String> {
                $( let $name = *lib
                    .get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!(stringify!($name), "\0").as_bytes())
                    .map_err(|e| format!("symbol {}: {e}", stringify!($name)))?; )*
                Ok(Ucp { _lib: lib, $($name,)* })
            }
        }
    };
}

ucp_fns! {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucs_status_string: fn(ucs_status_t) -> *const c_char;
    ucp_config_read: fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t;
    ucp_config_modify: fn(*mut ucp_config_t, *const c_char, *const c_char) -> ucs_status_t;
    ucp_config_release: fn(*mut ucp_config_t);
    ucp_init_version: fn(c_uint, c_uint, *const ucp_params_t, *const ucp_config_t, *mut ucp_context_h) -> ucs_status_t;
    ucp_cleanup: fn(ucp_context_h);
    ucp_worker_create: fn(ucp_context_h, *const ucp_worker_params_t, *mut ucp_worker_h) -> ucs_status_t;
    ucp_worker_destroy: fn(ucp_worker_h);
    ucp_worker_query: fn(ucp_worker_h, *mut ucp_worker_attr_t) -> ucs_status_t;
    ucp_worker_release_address: fn(ucp_worker_h, *mut ucp_address_t);
    ucp_worker_progress: fn(ucp_worker_h) -> c_uint;
    ucp_worker_get_efd: fn(ucp_worker_h, *mut c_int) -> ucs_status_t;
    ucp_worker_arm: fn(ucp_worker_h) -> ucs_status_t;
    ucp_worker_set_am_recv_handler: fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t;
    ucp_ep_create: fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t;
    ucp_ep_close_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_ep_flush_nbx: fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_mem_map: fn(ucp_context_h, *const ucp_mem_map_params_t, *mut ucp_mem_h) -> ucs_status_t;
    ucp_mem_unmap: fn(ucp_context_h, ucp_mem_h) -> ucs_status_t;
    ucp_rkey_pack: fn(ucp_context_h, ucp_mem_h, *mut *mut c_void, *mut usize) -> ucs_status_t;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t;
    ucp_rkey_destroy: fn(ucp_rkey_h);
    ucp_get_nbx: fn(ucp_ep_h, *mut c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_put_nbx: fn(ucp_ep_h, *const c_void, usize, u64, ucp_rkey_h, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_am_send_nbx: fn(ucp_ep_h, c_uint, *const c_void, usize, *const c_void, usize, *const ucp_request_param_t) -> ucs_status_ptr_t;
    ucp_request_check_status: fn(*mut c_void) -> ucs_status_t;
    ucp_request_free: fn(*mut c_void);
}

static UCP: OnceLock<Ucp> = OnceLock::new();
static LOAD_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Load `libucp` once per process. `path` is a file (`.../libucp.so.0`) or a
/// folder holding it; `None` asks the dynamic loader for `libucp.so.0`
/// (works after `libucx.load_library()` preloaded the wheel's copy).
/// Once a load succeeded, later calls return it whatever their `path`; a
/// failed load is not remembered (a later call may pass a better path).
pub fn load(path: Option<&Path>) -> Result<&'static Ucp> {
    if let Some(u) = UCP.get() {
        return Ok(u);
    }
    let _g = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(u) = UCP.get() {
        return Ok(u);
    }
    let file = match path {
        Some(p) if p.is_dir() => p.join("libucp.so.0"),
        Some(p) => p.to_path_buf(),
        None => "libucp.so.0".into(),
    };
    // SAFETY: loading UCX runs its constructors, which are well behaved.
    let lib = unsafe { libloading::Library::new(&file) }
        .map_err(|e| PdgateError::Transport(format!("cannot load {}: {e}", file.display())))?;
    let ucp = unsafe { Ucp::resolve(lib) }.map_err(PdgateError::Transport)?;
    let (mut a, mut b, mut c) = (0, 0, 0);
    unsafe { (ucp.ucp_get_version)(&mut a, &mut b, &mut c) };
    if a != UCP_API_MAJOR || b < 14 {
        return Err(PdgateError::Transport(format!(
            "UCX {a}.{b}.{c} is too old (need >= 1.14; declarations follow 1.22)"
        )));
    }
    Ok(UCP.get_or_init(|| ucp))
}

/// The loaded table; panics if [`load`] never succeeded (only called from
/// code that runs after a successful load).
pub fn ucp() -> &'static Ucp {
    UCP.get().expect("libucp not loaded")
}

/// `major.minor.release` of the loaded UCX.
pub fn version() -> Option<String> {
    let u = UCP.get()?;
    let (mut a, mut b, mut c) = (0, 0, 0);
    unsafe { (u.ucp_get_version)(&mut a, &mut b, &mut c) };
    Some(format!("{a}.{b}.{c}"))
}

/// UCX's text for a status code.
pub fn status_str(st: ucs_status_t) -> String {
    let p = unsafe { (ucp().ucs_status_string)(st) };
    if p.is_null() {
        return format!("status {st}");
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Decode a `ucs_status_ptr_t`: `Ok(None)` completed now, `Ok(Some(req))`
/// in progress, `Err(status)` failed.
pub fn status_ptr(p: ucs_status_ptr_t) -> std::result::Result<Option<*mut c_void>, ucs_status_t> {
    let v = p as usize;
    if v == 0 {
        Ok(None)
    } else if v >= UCS_ERR_LAST as usize {
        Err(v as isize as ucs_status_t)
    } else {
        Ok(Some(p))
    }
}

/// Map a UCX status to the core error type.
pub fn status_err(what: &str, st: ucs_status_t) -> PdgateError {
    let text = format!("{what}: {} ({st})", status_str(st));
    match st {
        // IO_ERROR, UNREACHABLE, REJECTED, NOT_CONNECTED, CONNECTION_RESET,
        // and the whole endpoint-failure range (-80..-89).
        -3 | -6 | -23 | -24 | -25 | -89..=-80 => PdgateError::PeerUnreachable(text),
        -20 => PdgateError::Timeout(text),
        _ => PdgateError::Transport(text),
    }
}
