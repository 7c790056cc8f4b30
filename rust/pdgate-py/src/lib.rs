//! `pdgate._native`: the thin PyO3 layer over `pdgate-core`.
//! Every blocking call releases the GIL; every core error maps to one
//! Python exception class (see `errors`).

use pyo3::prelude::*;

mod admission;
mod errors;
mod transfer;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    admission::register(m)?;
    transfer::register(m)?;
    Ok(())
}
