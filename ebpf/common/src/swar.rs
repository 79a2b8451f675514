//! Tests of all 8 bytes of a word at once (SWAR), for the probes' head scan and the look before
//! it: every helper here is exact for every byte of the word (or, where said, up to the first
//! byte that ends a run), which the tests below check exhaustively per byte and position.

#![expect(
    clippy::inline_always,
    reason = "the probes build this code too, where every helper is inlined on purpose (see ebpf/probes/src/main.rs)"
)]

pub(crate) const ONES: u64 = u64::MAX / 255;
pub(crate) const HIGH: u64 = ONES * 0x80;

/// The high bit of each byte of `word` in `from..=to` (both below 0x80): exact for every byte, as
/// `(byte | 0x80) - c` never borrows; bytes from 0x80 up are never in.
#[inline(always)]
pub(crate) const fn in_range(word: u64, from: u8, to: u8) -> u64 {
    let at_least_from = (word | HIGH).wrapping_sub(ONES * from as u64) & HIGH;
    let above_to = (word | HIGH).wrapping_sub(ONES * (to as u64 + 1)) & HIGH;
    at_least_from & !above_to & !word
}

/// How many bytes of `word`, from the first (lowest), come before the first whose flag (high
/// bit) is set in `flags`: 8 when none is.
#[inline(always)]
pub(crate) const fn before_first(flags: u64) -> u32 {
    flags.trailing_zeros() / 8
}

/// The first `n` bytes of a word (`n` at most 8).
#[inline(always)]
pub(crate) const fn first_bytes(n: u32) -> u64 {
    if n >= 8 { u64::MAX } else { (1 << (8 * n)) - 1 }
}

/// How many bytes of `word`, from the first, are in `lowest..=0x7e`.
#[inline(always)]
pub(crate) const fn run_from(word: u64, lowest: u8) -> u32 {
    before_first(!in_range(word, lowest, 0x7e) & HIGH)
}

/// How many bytes of `word`, from the first, are header name bytes the scan accepts (letters,
/// digits, `-`, `.`, `_`).
#[inline(always)]
pub(crate) const fn name_run(word: u64) -> u32 {
    let letters = in_range(word | (ONES * 0x20), b'a', b'z');
    let others = in_range(word, b'0', b'9') | in_range(word, b'-', b'.') | in_range(word, b'_', b'_');
    before_first(!(letters | others) & HIGH)
}

/// How many bytes of `word`, from the first, are spaces or tabs.
#[inline(always)]
pub(crate) const fn blank_run(word: u64) -> u32 {
    before_first(!(in_range(word, b' ', b' ') | in_range(word, b'\t', b'\t')) & HIGH)
}

/// How many bytes of `word`, from the first, are upper-case letters.
#[inline(always)]
pub(crate) const fn upper_run(word: u64) -> u32 {
    before_first(!in_range(word, b'A', b'Z') & HIGH)
}

/// `word` with its upper-case letters made lower case.
#[inline(always)]
pub(crate) const fn lower_case(word: u64) -> u64 {
    word | (in_range(word, b'A', b'Z') >> 2)
}

/// Whether `b` is a header name byte the scan accepts (see [`name_run`]).
#[inline(always)]
pub(crate) const fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')
}

/// The `k`th byte of `word` (`k` below 8).
#[inline(always)]
pub(crate) const fn byte_at(word: u64, k: u32) -> u8 {
    (word >> (8 * k)) as u8
}

/// The value of 8 lower-case hex digits, `word` little endian (the first digit lowest), or `None`
/// when a byte is not one: every byte tested at once, then the nibbles gathered in three steps.
#[inline(always)]
pub(crate) const fn hex_digits(word: u64) -> Option<u64> {
    if (in_range(word, b'0', b'9') | in_range(word, b'a', b'f')) != HIGH {
        return None;
    }
    // `0`-`9` are 0x30-0x39 and `a`-`f` 0x61-0x66: the low nibble, plus 9 for letters (bit 6).
    let nibbles = (word & (ONES * 0x0f)) + ((word >> 6) & ONES) * 9;
    // The first digit most significant: bytes reversed, then pairs, quads and halves joined.
    let n = nibbles.swap_bytes();
    let n = ((n >> 4) | n) & 0x00ff_00ff_00ff_00ff;
    let n = ((n >> 8) | n) & 0x0000_ffff_0000_ffff;
    let n = ((n >> 16) | n) & 0xffff_ffff;
    Some(n)
}

/// The value of the 2 lower-case hex digits `word` starts with, or `None`.
#[inline(always)]
pub(crate) const fn two_hex_digits(word: u64) -> Option<u64> {
    // The other 6 bytes are made `0` digits, which shift out below.
    match hex_digits((word & 0xffff) | ((ONES * b'0' as u64) & !0xffff)) {
        Some(digits) => Some(digits >> 24),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::prelude::rust_2024::*;

    use super::*;

    #[test]
    fn every_run_is_told_exactly_wherever_its_end_falls() {
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut bytes = *b"aZ0-._zA";
                bytes[at] = b;
                // Runs as long as the word, for the blank and capital runs too.
                for bytes in [bytes, blanks_with(b, at), capitals_with(b, at)] {
                    let word = u64::from_le_bytes(bytes);
                    let run = |f: &dyn Fn(u8) -> bool| bytes.iter().take_while(|b| f(**b)).count() as u32;
                    assert_eq!(name_run(word), run(&is_name_byte), "{bytes:?}");
                    assert_eq!(run_from(word, b' '), run(&|b| (b' '..=b'~').contains(&b)), "{bytes:?}");
                    assert_eq!(run_from(word, b'!'), run(&|b| (b'!'..=b'~').contains(&b)), "{bytes:?}");
                    assert_eq!(blank_run(word), run(&|b| b == b' ' || b == b'\t'), "{bytes:?}");
                    assert_eq!(upper_run(word), run(&|b| b.is_ascii_uppercase()), "{bytes:?}");
                    let lower: Vec<u8> = bytes.iter().map(u8::to_ascii_lowercase).collect();
                    assert_eq!(lower_case(word).to_le_bytes().as_slice(), lower.as_slice(), "{bytes:?}");
                }
            }
        }
    }

    fn blanks_with(b: u8, at: usize) -> [u8; 8] {
        let mut bytes = *b" \t \t    ";
        bytes[at] = b;
        bytes
    }

    fn capitals_with(b: u8, at: usize) -> [u8; 8] {
        let mut bytes = *b"GETPOSTX";
        bytes[at] = b;
        bytes
    }

    #[test]
    fn hex_digits_are_read_at_once_exactly_as_one_at_a_time() {
        let digits = *b"0af76519";
        assert_eq!(hex_digits(u64::from_le_bytes(digits)), Some(0x0af7_6519));
        assert_eq!(hex_digits(u64::from_le_bytes(*b"fedcba98")), Some(0xfedc_ba98));
        let parse = |bytes: &[u8]| {
            core::str::from_utf8(bytes)
                .ok()
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
                .and_then(|s| u64::from_str_radix(s, 16).ok())
        };
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut bytes = digits;
                bytes[at] = b;
                let word = u64::from_le_bytes(bytes);
                assert_eq!(hex_digits(word), parse(&bytes), "{bytes:?}");
                assert_eq!(two_hex_digits(word), parse(&bytes[..2]), "{bytes:?}");
            }
        }
    }
}
