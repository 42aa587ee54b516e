//! Arbitrary bytes as one client's byte stream into `kiln serve`'s router and HTTP/1 handling,
//! in front of the real engine on the fixture model: see `kiln_runtime::fuzzing::serve_request`
//! for the invariants. Seeds: `fuzz/seeds/serve_request/`, dictionary
//! `fuzz/dict/serve_request.dict`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As the `kiln` binary: a panic of the template engine is that input's error, any other
    // aborts (libFuzzer's hook, chained).
    kiln_runtime::contain::install_abort_hook();
    kiln_runtime::fuzzing::serve_request::run(data);
});
