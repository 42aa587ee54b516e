//! Calendar arithmetic on Unix time, UTC: the runtime library's ([`kiln_runtime::civil`]), which
//! the board uses too. Ground: no kiln concepts.

pub use kiln_runtime::civil::{civil_from_days, days_from_civil};
