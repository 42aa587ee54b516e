//! Pre-tokenizers: split a text fragment into words before BPE, as llama.cpp's `unicode.cpp`.
//!
//! Hand-written splitters, not a regex engine: llama.cpp itself runs the GPT-2 and llama3
//! expressions as hand-written code (`unicode_regex_split_custom_*`), and the others through
//! `std::regex` over a text whose code points are collapsed to one byte per Unicode category.
//! Porting that code is equality by construction; a regex engine with its own Unicode tables
//! would be a second implementation that could disagree at the edges.
//!
//! Every splitter works on code points and refines an existing list of pieces (lengths in code
//! points), as llama.cpp applies several expressions one after another.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// The code point classes llama.cpp's splitters look at (`unicode_cpt_flags`).
#[derive(Clone, Copy, Default)]
struct Flags {
    in_range: bool,
    letter: bool,
    number: bool,
    punct: bool,
    whitespace: bool,
}

fn flags(c: char) -> Flags {
    let cat = get_general_category(c);
    Flags {
        in_range: true,
        letter: matches!(
            cat,
            G::UppercaseLetter
                | G::LowercaseLetter
                | G::TitlecaseLetter
                | G::ModifierLetter
                | G::OtherLetter
        ),
        number: matches!(cat, G::DecimalNumber | G::LetterNumber | G::OtherNumber),
        punct: matches!(
            cat,
            G::ConnectorPunctuation
                | G::DashPunctuation
                | G::OpenPunctuation
                | G::ClosePunctuation
                | G::InitialPunctuation
                | G::FinalPunctuation
                | G::OtherPunctuation
        ),
        // llama.cpp's whitespace set is Unicode's White_Space property, as Rust's.
        whitespace: c.is_whitespace(),
    }
}

/// Which expressions a `tokenizer.ggml.pre` applies, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
    Gpt2,
    /// The llama3 expression with `\p{N}{1,max_digits}`: 3 for llama3, 1 for qwen2.
    Llama3 { max_digits: usize },
    /// `\p{N}`: every number code point alone.
    EachNumber,
    /// `\p{N}+`: runs of numbers.
    NumberRuns,
    /// `[\p{P}\$\+<=>\^~\|]+`: runs of punctuation and those ASCII symbols.
    PunctRuns,
    /// `[0-9][0-9][0-9]`
    ThreeAsciiDigits,
}

/// Split `text` into words (as UTF-8 strings) by applying `splits` in order.
pub fn split(text: &str, splits: &[Split]) -> Vec<String> {
    let cpts: Vec<char> = text.chars().collect();
    let mut offsets = vec![cpts.len()];
    for s in splits {
        offsets = match s {
            Split::Gpt2 => refine(&cpts, &offsets, gpt2),
            Split::Llama3 { max_digits } => {
                refine(&cpts, &offsets, |c, out| llama3(c, *max_digits, out))
            }
            Split::EachNumber => refine(&cpts, &offsets, |c, out| {
                runs(c, out, |ch| is_number_collapsed(ch), false)
            }),
            Split::NumberRuns => refine(&cpts, &offsets, |c, out| {
                runs(c, out, |ch| is_number_collapsed(ch), true)
            }),
            Split::PunctRuns => refine(&cpts, &offsets, |c, out| runs(c, out, is_punct_set, true)),
            Split::ThreeAsciiDigits => refine(&cpts, &offsets, three_digits),
        };
    }
    let mut words = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for len in offsets {
        words.push(cpts[start..start + len].iter().collect());
        start += len;
    }
    words
}

/// Apply one splitter to every piece; `f` returns the lengths of the sub-pieces of one piece.
fn refine(
    cpts: &[char],
    offsets: &[usize],
    mut f: impl FnMut(&[char], &mut Vec<usize>),
) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        f(&cpts[start..start + len], &mut out);
        start += len;
    }
    out
}

/// `\p{N}` as llama.cpp's collapsed std::regex sees it: ASCII 0-9, or a non-ASCII number that
/// is not whitespace.
fn is_number_collapsed(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    let f = flags(c);
    !f.whitespace && f.number
}

/// `[\p{P}\$\+<=>\^~\|]`: llama.cpp's ASCII punctuation list plus the listed symbols, or a
/// non-ASCII punctuation code point that is not whitespace.
fn is_punct_set(c: char) -> bool {
    if c.is_ascii() {
        return matches!(
            c,
            '!' | '"'
                | '#'
                | '%'..='*'
                | ','..='/'
                | ':'
                | ';'
                | '?'
                | '@'
                | '['..=']'
                | '_'
                | '{'
                | '}'
                | '$'
                | '+'
                | '<'
                | '='
                | '>'
                | '^'
                | '~'
                | '|'
        );
    }
    let f = flags(c);
    !f.whitespace && f.punct
}

/// std::regex_iterator semantics for a one-class pattern: matches (single code points, or
/// maximal runs) and the gaps between them are all pieces.
fn runs(c: &[char], out: &mut Vec<usize>, class: impl Fn(char) -> bool, greedy: bool) {
    let mut prev = 0;
    let mut pos = 0;
    while pos < c.len() {
        if class(c[pos]) {
            if pos > prev {
                out.push(pos - prev);
            }
            let start = pos;
            pos += 1;
            if greedy {
                while pos < c.len() && class(c[pos]) {
                    pos += 1;
                }
            }
            out.push(pos - start);
            prev = pos;
        } else {
            pos += 1;
        }
    }
    if c.len() > prev {
        out.push(c.len() - prev);
    }
}

fn three_digits(c: &[char], out: &mut Vec<usize>) {
    let mut prev = 0;
    let mut pos = 0;
    while pos + 3 <= c.len() {
        if c[pos..pos + 3].iter().all(|ch| ch.is_ascii_digit()) {
            if pos > prev {
                out.push(pos - prev);
            }
            out.push(3);
            pos += 3;
            prev = pos;
        } else {
            pos += 1;
        }
    }
    if c.len() > prev {
        out.push(c.len() - prev);
    }
}

/// Emits pieces ending at given positions (llama.cpp's `_add_token`).
struct Emit<'a> {
    out: &'a mut Vec<usize>,
    prev_end: usize,
}

impl Emit<'_> {
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

/// Flags at `pos`, or the all-false flags of llama.cpp's out-of-range position.
fn fl(c: &[char], pos: usize) -> Flags {
    c.get(pos).map(|&ch| flags(ch)).unwrap_or_default()
}

fn cp(c: &[char], pos: usize) -> Option<char> {
    c.get(pos).copied()
}

/// `unicode_regex_split_custom_gpt2`.
fn gpt2(c: &[char], out: &mut Vec<usize>) {
    let mut e = Emit { out, prev_end: 0 };
    let end = c.len();
    let mut pos = 0;
    while pos < end {
        let cpt = c[pos];
        let f = flags(cpt);
        if cpt == '\'' && pos + 1 < end {
            let next = c[pos + 1];
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += e.add(pos + 2);
                continue;
            }
            if pos + 2 < end {
                let nn = c[pos + 2];
                if (next == 'r' && nn == 'e')
                    || (next == 'v' && nn == 'e')
                    || (next == 'l' && nn == 'l')
                {
                    pos += e.add(pos + 3);
                    continue;
                }
            }
        }
        let mut f2 = if cpt == ' ' { fl(c, pos + 1) } else { f };
        if f2.letter {
            pos += usize::from(cpt == ' ');
            while f2.letter {
                pos += 1;
                f2 = fl(c, pos);
            }
            e.add(pos);
            continue;
        }
        if f2.number {
            pos += usize::from(cpt == ' ');
            while f2.number {
                pos += 1;
                f2 = fl(c, pos);
            }
            e.add(pos);
            continue;
        }
        if !(f2.whitespace || f2.letter || f2.number) && f2.in_range {
            pos += usize::from(cpt == ' ');
            while !(f2.whitespace || f2.letter || f2.number) && f2.in_range {
                pos += 1;
                f2 = fl(c, pos);
            }
            e.add(pos);
            continue;
        }
        let mut n_ws = 0;
        while fl(c, pos + n_ws).whitespace {
            n_ws += 1;
        }
        if n_ws > 1 && pos + n_ws < end {
            pos += n_ws - 1;
            e.add(pos);
            continue;
        }
        if n_ws > 0 {
            pos += n_ws;
            e.add(pos);
            continue;
        }
        pos += 1;
        e.add(pos);
    }
}

/// `unicode_regex_split_custom_llama3`, with the digit-group length a parameter: llama.cpp's
/// qwen2 expression (`\p{N}` alone) goes through std::regex, whose leftmost-first alternation
/// over these same alternatives splits the same way as this code with groups of one.
fn llama3(c: &[char], max_digits: usize, out: &mut Vec<usize>) {
    let mut e = Emit { out, prev_end: 0 };
    let end = c.len();
    let mut pos = 0;
    let is_rn = |ch: Option<char>| matches!(ch, Some('\r') | Some('\n'));
    while pos < end {
        let cpt = c[pos];
        let f = flags(cpt);
        if cpt == '\'' && pos + 1 < end {
            let next = c[pos + 1].to_ascii_lowercase();
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += e.add(pos + 2);
                continue;
            }
            if pos + 2 < end {
                let nn = c[pos + 2].to_ascii_lowercase();
                if (next == 'r' && nn == 'e')
                    || (next == 'v' && nn == 'e')
                    || (next == 'l' && nn == 'l')
                {
                    pos += e.add(pos + 3);
                    continue;
                }
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(cpt == '\r' || cpt == '\n' || f.number) && (f.letter || fl(c, pos + 1).letter) {
            pos += 1;
            while fl(c, pos).letter {
                pos += 1;
            }
            e.add(pos);
            continue;
        }
        // \p{N}{1,max_digits}
        if f.number {
            let mut ini = pos;
            while fl(c, pos).number {
                pos += 1;
                if pos - ini >= max_digits {
                    e.add(pos);
                    ini = pos;
                }
            }
            e.add(pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+[\r\n]*
        let mut f2 = if cpt == ' ' { fl(c, pos + 1) } else { f };
        if !(f2.whitespace || f2.letter || f2.number) && f.in_range {
            pos += usize::from(cpt == ' ');
            while !(f2.whitespace || f2.letter || f2.number) && f2.in_range {
                pos += 1;
                f2 = fl(c, pos);
            }
            while is_rn(cp(c, pos)) {
                pos += 1;
            }
            e.add(pos);
            continue;
        }
        let mut n_ws = 0;
        let mut last_rn = 0;
        while fl(c, pos + n_ws).whitespace {
            if is_rn(cp(c, pos + n_ws)) {
                last_rn = pos + n_ws + 1;
            }
            n_ws += 1;
        }
        // \s*[\r\n]+
        if last_rn > 0 {
            pos = last_rn;
            e.add(pos);
            continue;
        }
        // \s+(?!\S)
        if n_ws > 1 && pos + n_ws < end {
            pos += n_ws - 1;
            e.add(pos);
            continue;
        }
        if n_ws > 0 {
            pos += n_ws;
            e.add(pos);
            continue;
        }
        pos += 1;
        e.add(pos);
    }
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest to U+0100….
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        // Every value here is below U+0200: always a char.
        table[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str, splits: &[Split]) -> Vec<String> {
        split(text, splits)
    }

    #[test]
    fn gpt2_splits_like_the_regex() {
        let w = words("Hello world's  123 !!x\n\n  end", &[Split::Gpt2]);
        assert_eq!(
            w,
            ["Hello", " world", "'s", " ", " 123", " !!", "x", "\n\n ", " end"]
        );
    }

    #[test]
    fn smollm_splits_each_digit_first() {
        let w = words("abc 2024x", &[Split::EachNumber, Split::Gpt2]);
        assert_eq!(w, ["abc", " ", "2", "0", "2", "4", "x"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_qwen2_by_one() {
        let w = words(
            "12345 I'M here\r\n\n  x",
            &[Split::Llama3 { max_digits: 3 }],
        );
        assert_eq!(w, ["123", "45", " I", "'M", " here", "\r\n\n", " ", " x"]);
        let w = words("1234", &[Split::Llama3 { max_digits: 1 }]);
        assert_eq!(w, ["1", "2", "3", "4"]);
    }

    #[test]
    fn default_applies_four_expressions() {
        let splits = [
            Split::PunctRuns,
            Split::Gpt2,
            Split::NumberRuns,
            Split::ThreeAsciiDigits,
        ];
        let w = words("a+=b 12345", &splits);
        assert_eq!(w, ["a", "+=", "b", " ", "123", "45"]);
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let mut seen = std::collections::HashSet::new();
        assert!(t.iter().all(|c| seen.insert(*c)));
    }
}
