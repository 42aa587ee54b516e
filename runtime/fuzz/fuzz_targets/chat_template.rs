//! An arbitrary chat template and conversation into the renderer: Ok or Err within its fuel,
//! never a panic, never over the output cap (`kiln_runtime::fuzzing::chat_template`). Seeds:
//! `fuzz/seeds/chat_template/` (the real templates of `tests/*.jinja`, and hostile ones),
//! dictionary `fuzz/dict/chat_template.dict`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As the `kiln` binary: a panic of the template engine is that input's error, any other
    // aborts (libFuzzer's hook, chained).
    kiln_runtime::contain::install_abort_hook();
    kiln_runtime::fuzzing::chat_template::run(data);
});
