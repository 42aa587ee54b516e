//! The GGUF parser on arbitrary bytes: it must return an error or a header whose every tensor
//! view lies inside the input, and dequantising any view must not panic.
#![no_main]

use kiln_runtime::gguf::Gguf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else {
        return;
    };
    for t in g.tensor_infos() {
        let v = g
            .view(data, t)
            .expect("a parsed tensor lies inside the input");
        assert_eq!(v.data.len() as u64, t.n_bytes);
        let _ = v.to_f32();
    }
});
