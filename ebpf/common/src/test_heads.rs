//! Request heads for the unit tests of the head scans (`line_starts`, `head_drop`).

extern crate std;
use std::prelude::rust_2024::*;

/// `request_line`, then each of `lines`, each ended by CRLF, then the empty line that ends a head.
pub(crate) fn request_head(request_line: &[u8], lines: &[&[u8]]) -> Vec<u8> {
    let mut out = request_line.to_vec();
    out.extend_from_slice(b"\r\n");
    for line in lines {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}
