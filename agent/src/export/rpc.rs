//! The error details OTLP servers send: `google.rpc.Status` (the body of an OTLP/HTTP error, the
//! `grpc-status-details-bin` of a gRPC one), with `google.rpc.RetryInfo` inside. Just the fields the
//! exporter reads, decoded with prost.

#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Any {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    pub retry_delay: Option<Duration>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Duration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

pub const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// The message of an OTLP/HTTP error body, when it is a `google.rpc.Status` with one (printable,
/// and cut to 200 characters: it goes into a log line).
#[must_use]
pub fn error_message(body: &[u8]) -> Option<String> {
    let status = <Status as prost::Message>::decode(body).ok()?;
    let message: String = status.message.chars().filter(|c| !c.is_control()).take(200).collect();
    (!message.is_empty()).then_some(message)
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn an_error_body_gives_its_message() {
        let body = Status { code: 3, message: "bad\nspan".into(), details: vec![] }.encode_to_vec();
        assert_eq!(error_message(&body).as_deref(), Some("badspan"));
        assert_eq!(error_message(b"<html>oops</html>"), None);
        assert_eq!(error_message(&[]), None);
    }
}
