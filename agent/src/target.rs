//! From a request target to the `url.*` attributes, with the privacy the HTTP semantic conventions
//! ask for: the values of query keys that carry credentials become `REDACTED` (the key stays), and
//! `url.full` never carries a user name or password.
//!
//! Everything here borrows: a target without anything to hide gives sub-slices of the captured
//! string, and only a redacted query or a rebuilt URL is written into the spans' arena.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use bumpalo::Bump;
use bumpalo::collections::String as BumpString;

/// What a redacted value becomes.
pub const REDACTED: &str = "REDACTED";

/// Query keys whose values are credentials: the semantic conventions' list for `url.query` and
/// `url.full`, matched exactly (case-sensitively) as the list is written.
pub const SENSITIVE_QUERY_KEYS: [&str; 4] = ["AWSAccessKeyId", "Signature", "sig", "X-Goog-Signature"];

/// A request target split into its parts (RFC 9112 section 3.2). Parts are sub-slices of the
/// target; a fragment is kept when a client sent one, although it should not have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// `/path?query`: the usual form.
    Origin { path: &'a str, query: Option<&'a str>, fragment: Option<&'a str> },
    /// `scheme://[userinfo@]host[:port][/path][?query]`: requests to a forward proxy, and what
    /// `HAProxy` forwards in some configurations.
    Absolute {
        scheme: &'a str,
        userinfo: Option<&'a str>,
        /// `host[:port]`, with IPv6 literals in brackets as written.
        host_port: &'a str,
        /// Empty when the target has no path (`http://host?q`).
        path: &'a str,
        query: Option<&'a str>,
        fragment: Option<&'a str>,
    },
    /// `host:port` (CONNECT). A user name before `@`, which the grammar does not allow but a
    /// client may send, is kept apart so that it is never exported.
    Authority { userinfo: Option<&'a str>, host_port: &'a str },
    /// `*` (a server-wide OPTIONS).
    Asterisk,
}

impl<'a> Target<'a> {
    #[must_use]
    pub fn parse(target: &'a str) -> Self {
        if target == "*" {
            return Self::Asterisk;
        }
        if target.starts_with('/') {
            let (rest, fragment) = split_off(target, '#');
            let (path, query) = split_off(rest, '?');
            return Self::Origin { path, query, fragment };
        }
        if let Some((scheme, rest)) = target.split_once("://")
            && is_scheme(scheme)
        {
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, rest) = rest.split_at(authority_end);
            let (userinfo, host_port) = split_userinfo(authority);
            let (rest, fragment) = split_off(rest, '#');
            let (path, query) = split_off(rest, '?');
            return Self::Absolute { scheme, userinfo, host_port, path, query, fragment };
        }
        let (userinfo, host_port) = split_userinfo(target);
        Self::Authority { userinfo, host_port }
    }

    /// `url.path`. An absolute-form target without a path asks for `/` (RFC 9112 section 3.2.2).
    /// Authority and asterisk forms have no path; the conventions still want `url.path` on server
    /// spans, so they give the target itself, without any user name.
    #[must_use]
    pub fn path(&self) -> &'a str {
        match *self {
            Self::Absolute { path: "", .. } => "/",
            Self::Origin { path, .. } | Self::Absolute { path, .. } => path,
            Self::Authority { host_port, .. } => host_port,
            Self::Asterisk => "*",
        }
    }

    /// The raw query, without `?` (not scrubbed: see [`scrub_query`]).
    #[must_use]
    pub fn query(&self) -> Option<&'a str> {
        match *self {
            Self::Origin { query, .. } | Self::Absolute { query, .. } => query,
            Self::Authority { .. } | Self::Asterisk => None,
        }
    }

    /// `url.full` of a request sent to `server`: the target URI as RFC 9112 section 3.3
    /// reconstructs it, with credentials in the query redacted and any user information replaced
    /// by `REDACTED` (as the conventions ask: `http://REDACTED:REDACTED@host/`). The scheme is
    /// `http` unless an absolute-form target says otherwise: the agent only sees plain-text
    /// traffic. `None` when the target does not name its host and the server is unknown.
    ///
    /// Borrows `original` (the unparsed target) when it is already an absolute URL with nothing to
    /// hide; otherwise writes into `bump`.
    #[must_use]
    pub fn full_url(
        &self,
        original: &'a str,
        scheme: &str,
        server: Option<SocketAddr>,
        bump: &'a Bump,
    ) -> Option<&'a str> {
        let mut url = BumpString::new_in(bump);
        match *self {
            Self::Origin { path, query, fragment } => {
                let server = server?;
                url.push_str(scheme);
                url.push_str("://");
                push_authority(&mut url, server);
                url.push_str(path);
                push_query_and_fragment(&mut url, query, fragment);
            }
            Self::Absolute { scheme, userinfo, host_port, path, query, fragment } => {
                if userinfo.is_none() && query.is_none_or(|q| !needs_scrubbing(q)) {
                    return Some(original);
                }
                url.push_str(scheme);
                url.push_str("://");
                push_redacted_userinfo(&mut url, userinfo);
                url.push_str(host_port);
                url.push_str(path);
                push_query_and_fragment(&mut url, query, fragment);
            }
            // The target URI of these two forms has an empty path and query (RFC 9112 section 3.3).
            Self::Authority { userinfo, host_port } => {
                url.push_str(scheme);
                url.push_str("://");
                push_redacted_userinfo(&mut url, userinfo);
                url.push_str(host_port);
            }
            Self::Asterisk => {
                let server = server?;
                url.push_str(scheme);
                url.push_str("://");
                push_authority(&mut url, server);
            }
        }
        Some(url.into_bump_str())
    }
}

/// Appends `addr` as `SocketAddr`'s `Display` writes it, the authority of a URL: `192.0.2.1:80`,
/// `[2001:db8::1]:80`. IPv4 (nearly every address here) is written digit by digit: the formatting
/// machinery was a twentieth of the agent's work per kept request (issue 32).
pub fn push_authority(out: &mut BumpString<'_>, addr: SocketAddr) {
    match addr {
        SocketAddr::V4(v4) => {
            push_ip(out, IpAddr::V4(*v4.ip()));
            out.push(':');
            push_decimal(out, v4.port());
        }
        SocketAddr::V6(_) => {
            let _ = write!(out, "{addr}");
        }
    }
}

/// Appends `ip` as its `Display` writes it; IPv4 digit by digit (see [`push_authority`]).
pub fn push_ip(out: &mut BumpString<'_>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                push_decimal(out, u16::from(octet));
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(out, "{v6}");
        }
    }
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut BumpString<'_>, mut n: u16) {
    let mut digits = [0u8; 5];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &digit in &digits[start..] {
        out.push(char::from(digit));
    }
}

/// `scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )` (RFC 3986 section 3.1).
fn is_scheme(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

/// Splits at the first `at`: the part before, and the part after (without `at`) if it occurs.
fn split_off(s: &str, at: char) -> (&str, Option<&str>) {
    match s.split_once(at) {
        Some((before, after)) => (before, Some(after)),
        None => (s, None),
    }
}

/// A request line as a client sent it, possibly malformed and possibly cut short (the prefix of a
/// request `HAProxy` rejected), made safe to export. Only its first three words are kept (method,
/// target, version: anything after is not a request line's). In each word, a userinfo is replaced
/// by `REDACTED@`: everything up to the word's last `@`, after `scheme://` or from the word's start
/// (the authority form of `CONNECT`), but not in an origin-form path (`/...`); and a query gets the
/// redactions of [`scrub_query`]. The last word of a line cut before its version may have lost
/// its `@`: an absolute URL there keeps only its scheme. Borrows `line` when there is nothing to do.
pub fn scrub_request_line<'a>(line: &'a str, bump: &'a Bump) -> &'a str {
    let words: Vec<&str> = line.split(' ').take(3).collect();
    let cut = words.len() < 3;
    let risky = |w: &str| w.contains(['?', '@']) || (cut && w.contains("://"));
    if !words.iter().any(|w| risky(w)) && line.split(' ').nth(3).is_none() {
        return line;
    }
    let mut out = BumpString::with_capacity_in(line.len() + 2 * REDACTED.len(), bump);
    for (i, word) in words.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let (scheme, rest) = match word.find("://") {
            Some(at) => word.split_at(at + 3),
            None => ("", *word),
        };
        out.push_str(scheme);
        if cut && i + 1 == words.len() && !scheme.is_empty() && !rest.contains('@') {
            out.push_str(REDACTED);
            continue;
        }
        let rest = match rest.rfind('@') {
            Some(at) if !rest.starts_with('/') => {
                out.push_str(REDACTED);
                out.push('@');
                &rest[at + 1..]
            }
            _ => rest,
        };
        match rest.split_once('?') {
            Some((before, query)) => {
                out.push_str(before);
                out.push('?');
                push_scrubbed(&mut out, query);
            }
            None => out.push_str(rest),
        }
    }
    out.into_bump_str()
}

/// Splits an authority at its last `@`: a password may hold an unescaped `@`, a host may not.
fn split_userinfo(authority: &str) -> (Option<&str>, &str) {
    match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (Some(userinfo), host_port),
        None => (None, authority),
    }
}

/// `REDACTED:REDACTED@` for a user and password, `REDACTED@` for a user alone: the shape of the
/// original stays visible, its content does not.
fn push_redacted_userinfo(url: &mut BumpString<'_>, userinfo: Option<&str>) {
    let Some(userinfo) = userinfo else { return };
    url.push_str(REDACTED);
    if userinfo.contains(':') {
        url.push(':');
        url.push_str(REDACTED);
    }
    url.push('@');
}

fn push_query_and_fragment(url: &mut BumpString<'_>, query: Option<&str>, fragment: Option<&str>) {
    if let Some(query) = query {
        url.push('?');
        push_scrubbed(url, query);
    }
    if let Some(fragment) = fragment {
        url.push('#');
        url.push_str(fragment);
    }
}

/// `url.query` with the value of every sensitive key (see [`SENSITIVE_QUERY_KEYS`]) replaced by
/// `REDACTED`; everything else byte for byte. Borrows `query` when nothing needs redacting, so
/// the common case costs neither a copy nor arena space.
#[must_use]
pub fn scrub_query<'a>(query: &'a str, bump: &'a Bump) -> &'a str {
    if !needs_scrubbing(query) {
        return query;
    }
    let mut out = BumpString::with_capacity_in(query.len() + REDACTED.len(), bump);
    push_scrubbed(&mut out, query);
    out.into_bump_str()
}

fn needs_scrubbing(query: &str) -> bool {
    query.split('&').any(|pair| sensitive_value(pair).is_some_and(|value| value != REDACTED))
}

fn push_scrubbed(out: &mut BumpString<'_>, query: &str) {
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match sensitive_value(pair) {
            Some(value) => {
                out.push_str(&pair[..pair.len() - value.len()]);
                out.push_str(REDACTED);
            }
            None => out.push_str(pair),
        }
    }
}

/// The value of a `key=value` pair whose key is sensitive, even when empty (`sig=` becomes
/// `sig=REDACTED`, so what a reader sees does not depend on the value). A key without `=` has no
/// value to hide.
fn sensitive_value(pair: &str) -> Option<&str> {
    let (key, value) = pair.split_once('=')?;
    SENSITIVE_QUERY_KEYS.iter().any(|k| decodes_to(key.as_bytes(), k.as_bytes())).then_some(value)
}

/// True when `raw`, percent-decoded, is exactly `want`: a server decodes `%73ig` to `sig` before it
/// reads the parameter, so the encoded spelling carries the same credential. A `%` not followed by
/// two hex digits stands for itself (as `percent-encoding` decodes it). No allocation: bytes are
/// decoded as they are compared.
fn decodes_to(raw: &[u8], want: &[u8]) -> bool {
    // Percent-encoding only makes a key longer, so most keys are told apart by length.
    raw.len() >= want.len() && percent_encoding::percent_decode(raw).eq(want.iter().copied())
}

/// `s` cut to at most `limit` characters (Unicode scalar values, as the attribute limits of the
/// `OTel` SDK specification count them), on a character boundary; a sub-slice, never a copy.
#[must_use]
pub fn truncate_chars(s: &str, limit: usize) -> &str {
    // A string of no more bytes than the limit has no more characters either.
    if s.len() <= limit {
        return s;
    }
    match s.char_indices().nth(limit) {
        Some((end, _)) => &s[..end],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrub(q: &str) -> String {
        scrub_query(q, &Bump::new()).to_owned()
    }

    #[test]
    fn a_rejected_request_line_loses_its_credentials() {
        let bump = Bump::new();
        let scrub = |line| scrub_request_line(line, &bump);
        assert_eq!(scrub("GET /a\\x01 HTTP/1.1"), "GET /a\\x01 HTTP/1.1");
        assert_eq!(scrub("GET /x?sig=abc&a=1 HTTP/1.1"), "GET /x?sig=REDACTED&a=1 HTTP/1.1");
        assert_eq!(
            scrub("GET http://user:pw@host:8080/p?Signature=s HTTX/1.1"),
            "GET http://REDACTED@host:8080/p?Signature=REDACTED HTTX/1.1"
        );
        assert_eq!(scrub("GET http://u@h HTTP/1.1"), "GET http://REDACTED@h HTTP/1.1");
        assert_eq!(scrub("GET http://u:p?w@h/x HTTP/1.1"), "GET http://REDACTED@h/x HTTP/1.1", "? in userinfo");
        assert_eq!(scrub("GET http://u:p/w@h/x HTTP/1.1"), "GET http://REDACTED@h/x HTTP/1.1", "/ in userinfo");
        assert_eq!(scrub("CONNECT user:pw@host:443 HTTP/1.1"), "CONNECT REDACTED@host:443 HTTP/1.1");
        assert_eq!(scrub("GET /users/@me HTTP/1.1"), "GET /users/@me HTTP/1.1", "a path's @ is no userinfo");
        assert_eq!(scrub("GET http://user:longtoken"), "GET http://REDACTED", "cut before its @");
        assert_eq!(scrub("GET / HTTP/1.1 Authorization: x"), "GET / HTTP/1.1", "three words at most");
        assert_eq!(scrub("GET /?a=1?sig=2 HTTP/1.1"), "GET /?a=1?sig=2 HTTP/1.1");
    }

    #[test]
    fn sensitive_keys_are_redacted_in_any_position() {
        assert_eq!(scrub("sig=abc&a=1&b=2"), "sig=REDACTED&a=1&b=2");
        assert_eq!(scrub("a=1&Signature=abc&b=2"), "a=1&Signature=REDACTED&b=2");
        assert_eq!(scrub("a=1&b=2&X-Goog-Signature=abc"), "a=1&b=2&X-Goog-Signature=REDACTED");
        assert_eq!(
            scrub("AWSAccessKeyId=AKIA&Expires=1&Signature=xyz%2B%3D"),
            "AWSAccessKeyId=REDACTED&Expires=1&Signature=REDACTED"
        );
    }

    #[test]
    fn repeated_keys_are_all_redacted() {
        assert_eq!(scrub("sig=a&sig=b&x=sig&sig=c"), "sig=REDACTED&sig=REDACTED&x=sig&sig=REDACTED");
    }

    #[test]
    fn keys_must_match_exactly() {
        for q in ["design=1", "sig2=1", "xsig=1", "Sig=1", "SIG=1", "signature=1", "x=sig", "a=sig=1", "sig", "sig&x=1"]
        {
            assert_eq!(scrub(q), q);
        }
    }

    #[test]
    fn empty_values_and_odd_pairs() {
        assert_eq!(scrub("sig="), "sig=REDACTED");
        assert_eq!(scrub("sig=&a="), "sig=REDACTED&a=");
        assert_eq!(scrub("sig=a=b"), "sig=REDACTED", "the value runs to the next &");
        assert_eq!(scrub(""), "");
        assert_eq!(scrub("&&sig=1&&"), "&&sig=REDACTED&&");
        assert_eq!(scrub("=1&sig=2"), "=1&sig=REDACTED");
    }

    #[test]
    fn percent_encoded_keys_are_decoded_values_are_not() {
        assert_eq!(scrub("%73ig=1"), "%73ig=REDACTED");
        assert_eq!(scrub("X%2DGoog%2dSignature=1"), "X%2DGoog%2dSignature=REDACTED");
        assert_eq!(scrub("%53ignature=a%26b"), "%53ignature=REDACTED");
        assert_eq!(scrub("si%67%=1"), "si%67%=1", "a stray % is a literal, and sig% is another key");
        assert_eq!(scrub("s%ig=1"), "s%ig=1");
        assert_eq!(scrub("a=%73ig"), "a=%73ig");
    }

    #[test]
    fn nothing_to_hide_borrows() {
        let bump = Bump::new();
        for q in ["id=7&sort=asc", "sig=REDACTED&a=1", "design=1", ""] {
            assert!(std::ptr::eq(scrub_query(q, &bump), q), "{q}");
        }
        let before = bump.allocated_bytes();
        let _ = scrub_query("id=7&sort=asc", &bump);
        assert_eq!(bump.allocated_bytes(), before);
    }

    fn full(target: &str, server: Option<&str>) -> Option<String> {
        let bump = Bump::new();
        Target::parse(target).full_url(target, "http", server.map(|s| s.parse().unwrap()), &bump).map(str::to_owned)
    }

    #[test]
    fn full_url_of_an_origin_form_over_tls_says_https() {
        let bump = Bump::new();
        let url = Target::parse("/a").full_url("/a", "https", Some("10.0.0.1:443".parse().unwrap()), &bump);
        assert_eq!(url, Some("https://10.0.0.1:443/a"));
    }

    #[test]
    fn full_url_of_origin_form() {
        assert_eq!(full("/a/b?x=1", Some("10.0.0.1:8080")).as_deref(), Some("http://10.0.0.1:8080/a/b?x=1"));
        assert_eq!(full("/a", Some("[2001:db8::1]:80")).as_deref(), Some("http://[2001:db8::1]:80/a"));
        assert_eq!(
            full("/a?sig=s3cret&b=2", Some("10.0.0.1:80")).as_deref(),
            Some("http://10.0.0.1:80/a?sig=REDACTED&b=2")
        );
        assert_eq!(full("/a?", Some("10.0.0.1:80")).as_deref(), Some("http://10.0.0.1:80/a?"));
        assert_eq!(full("/a", None), None, "no host to name");
    }

    #[test]
    fn full_url_of_absolute_form() {
        let plain = "http://shop.example:8080/p/q?x=1";
        assert_eq!(full(plain, Some("10.0.0.1:80")).as_deref(), Some(plain), "the target names its own host");
        assert_eq!(full(plain, None).as_deref(), Some(plain));
        assert_eq!(
            full("http://alice:pa55@shop.example:8080/p?sig=abc&x=1", None).as_deref(),
            Some("http://REDACTED:REDACTED@shop.example:8080/p?sig=REDACTED&x=1")
        );
        assert_eq!(full("http://token@h/p", None).as_deref(), Some("http://REDACTED@h/p"));
        assert_eq!(
            full("http://a:p@ss:w@rd@h:1/x", None).as_deref(),
            Some("http://REDACTED:REDACTED@h:1/x"),
            "the host starts after the last @"
        );
        assert_eq!(full("http://[::1]:8080/a", None).as_deref(), Some("http://[::1]:8080/a"));
        assert_eq!(full("http://u:p@[::1]:8080", None).as_deref(), Some("http://REDACTED:REDACTED@[::1]:8080"));
        assert_eq!(full("http://h", None).as_deref(), Some("http://h"), "no path, no query");
        assert_eq!(full("http://h?sig=1", None).as_deref(), Some("http://h?sig=REDACTED"));
        assert_eq!(
            full("http://h/a?x=@y", None).as_deref(),
            Some("http://h/a?x=@y"),
            "an @ in the query is not userinfo"
        );
        assert_eq!(full("http://h/a#f@g", None).as_deref(), Some("http://h/a#f@g"));
        assert_eq!(full("HTTP://h/a?sig=1#frag", None).as_deref(), Some("HTTP://h/a?sig=REDACTED#frag"));
    }

    #[test]
    fn absolute_form_without_secrets_borrows_the_target() {
        let bump = Bump::new();
        let target = "http://h:1/a?b=2";
        assert!(std::ptr::eq(Target::parse(target).full_url(target, "http", None, &bump).unwrap(), target));
    }

    #[test]
    fn full_url_of_authority_and_asterisk_forms() {
        assert_eq!(full("example.com:443", Some("10.0.0.1:80")).as_deref(), Some("http://example.com:443"));
        assert_eq!(full("u:p@example.com:443", None).as_deref(), Some("http://REDACTED:REDACTED@example.com:443"));
        assert_eq!(full("[::1]:443", None).as_deref(), Some("http://[::1]:443"));
        assert_eq!(full("*", Some("10.0.0.1:80")).as_deref(), Some("http://10.0.0.1:80"));
        assert_eq!(full("*", None), None);
    }

    #[test]
    fn paths_and_queries_of_each_form() {
        let t = Target::parse("/a/b?x=1#f");
        assert_eq!((t.path(), t.query()), ("/a/b", Some("x=1")));
        let t = Target::parse("http://h?x=/y");
        assert_eq!((t.path(), t.query()), ("/", Some("x=/y")), "a / in the query is not the path");
        let t = Target::parse("http://u:p@h/z?q");
        assert_eq!((t.path(), t.query()), ("/z", Some("q")));
        let t = Target::parse("u:p@h:443");
        assert_eq!((t.path(), t.query()), ("h:443", None), "no credentials in url.path either");
        assert_eq!(Target::parse("*").path(), "*");
        assert_eq!(Target::parse("/").query(), None);
        assert!(matches!(Target::parse("1http://h/"), Target::Authority { .. }), "not a scheme");
    }

    #[test]
    fn truncation_counts_characters() {
        assert_eq!(truncate_chars("abcdef", 3), "abc");
        assert_eq!(truncate_chars("abc", 3), "abc");
        assert_eq!(truncate_chars("abc", 0), "");
        assert_eq!(truncate_chars("héllo", 2), "hé", "é is two bytes, one character");
        assert_eq!(truncate_chars("日本語テキスト", 3), "日本語");
        assert_eq!(truncate_chars("日本語", 3), "日本語", "9 bytes, 3 characters: not cut");
        assert_eq!(truncate_chars("a😀b", 2), "a😀");
        assert_eq!(truncate_chars("", 5), "");
    }

    proptest::proptest! {
        /// What is written digit by digit is what `Display` writes.
        #[test]
        fn addresses_are_written_as_display_writes_them(octets: [u8; 4], segments: [u16; 8], port: u16) {
            let bump = Bump::new();
            for addr in [
                SocketAddr::from((std::net::Ipv4Addr::from(octets), port)),
                SocketAddr::from((std::net::Ipv6Addr::from(segments), port)),
            ] {
                let mut authority = BumpString::new_in(&bump);
                push_authority(&mut authority, addr);
                proptest::prop_assert_eq!(authority.as_str(), addr.to_string());
                let mut ip = BumpString::new_in(&bump);
                push_ip(&mut ip, addr.ip());
                proptest::prop_assert_eq!(ip.as_str(), addr.ip().to_string());
            }
        }
    }

    proptest::proptest! {
        /// Pairs of sensitive keys (plainly or percent-encoded), near misses and ordinary keys:
        /// every sensitive value is gone, every other pair is unchanged.
        #[test]
        fn scrubbing_hides_sensitive_values_and_keeps_the_rest(
            pairs in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "sig", "Signature", "AWSAccessKeyId", "X-Goog-Signature", "%73ig", "X%2DGoog-Signature",
                        "design", "Sig", "sig2", "signature", "x", "id", "", "s%ig",
                    ]),
                    proptest::option::of("[^&#]{0,12}"),
                ),
                0..8,
            )
        ) {
            let query = pairs
                .iter()
                .map(|(k, v)| v.as_ref().map_or_else(|| (*k).to_owned(), |v| format!("{k}={v}")))
                .collect::<Vec<_>>()
                .join("&");
            let bump = Bump::new();
            let out = scrub_query(&query, &bump);
            let out_pairs: Vec<&str> = out.split('&').collect();
            let in_pairs: Vec<&str> = query.split('&').collect();
            proptest::prop_assert_eq!(out_pairs.len(), in_pairs.len());
            for (i, (key, value)) in pairs.iter().enumerate() {
                let sensitive = ["sig", "Signature", "AWSAccessKeyId", "X-Goog-Signature", "%73ig", "X%2DGoog-Signature"]
                    .contains(key);
                match value {
                    Some(_) if sensitive => proptest::prop_assert_eq!(out_pairs[i], format!("{key}={REDACTED}")),
                    _ => proptest::prop_assert_eq!(out_pairs[i], in_pairs[i]),
                }
            }
            if !needs_scrubbing(&query) {
                proptest::prop_assert!(std::ptr::eq(out, query.as_str()));
            }
        }
    }
}
