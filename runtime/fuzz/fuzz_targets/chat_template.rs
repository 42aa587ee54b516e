//! An arbitrary chat template and conversation into the renderer: Ok or Err within its fuel,
//! never a panic, never over the output cap (`kiln_runtime::fuzzing::chat_template`). Seeds:
//! `fuzz/seeds/chat_template/` (the real templates of `tests/*.jinja`, and hostile ones),
//! dictionary `fuzz/dict/chat_template.dict`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kiln_runtime::fuzzing::chat_template::run(data);
});
