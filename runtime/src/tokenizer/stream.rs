//! UTF-8-safe streaming of decoded pieces: a character split across tokens (an emoji is often
//! four byte tokens) is held back until it is complete.

/// UTF-8-safe streaming: pieces in, complete characters out.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append `piece`; return every complete character so far. Bytes that can never be valid
    /// UTF-8 come out as U+FFFD; an incomplete sequence at the end waits for the next piece.
    pub fn push(&mut self, piece: &[u8]) -> String {
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // The prefix is valid by construction.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whatever is left (an incomplete character) as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_a_split_character_until_complete() {
        let mut d = StreamDecoder::new();
        let e = "é😀".as_bytes();
        assert_eq!(d.push(&e[..1]), "");
        assert_eq!(d.push(&e[1..3]), "é");
        assert_eq!(d.push(&e[3..5]), "");
        assert_eq!(d.push(&e[5..]), "😀");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(b"a\xffb\xf0\x9f"), "a\u{FFFD}b");
        assert_eq!(d.finish(), "\u{FFFD}");
    }

    #[test]
    fn concatenation_equals_lossy_decoding_of_the_whole() {
        let bytes = "héllo wörld 😀 中文\u{301}".as_bytes();
        for cut in 1..6 {
            let mut d = StreamDecoder::new();
            let mut s = String::new();
            for chunk in bytes.chunks(cut) {
                s.push_str(&d.push(chunk));
            }
            s.push_str(&d.finish());
            assert_eq!(s.as_bytes(), bytes, "chunks of {cut}");
        }
    }
}
