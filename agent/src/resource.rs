//! The one place that builds the resource attributes of what the agent exports: its spans (one
//! resource per traced process, `process.pid` added by the encoder) and its own metrics.

/// Resource attributes shared by every traced process: `service.name` first, then
/// `OTEL_RESOURCE_ATTRIBUTES` (its `service.name` is overridden by `OTEL_SERVICE_NAME`), then
/// `host.name` and `k8s.node.name` unless given.
#[must_use]
pub fn attributes(
    service_name: &str,
    configured: &[(String, String)],
    node_name: Option<&str>,
) -> Vec<(String, String)> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let mut attributes: Vec<(String, String)> =
        configured.iter().filter(|(k, _)| k != "service.name").cloned().collect();
    attributes.insert(0, ("service.name".to_owned(), service_name.to_owned()));
    if !host.is_empty() && !attributes.iter().any(|(k, _)| k == "host.name") {
        attributes.push(("host.name".to_owned(), host));
    }
    if let Some(node) = node_name
        && !attributes.iter().any(|(k, _)| k == "k8s.node.name")
    {
        attributes.push(("k8s.node.name".to_owned(), node.to_owned()));
    }
    attributes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_comes_first_and_wins() {
        let configured = vec![("service.name".to_owned(), "ignored".to_owned()), ("env".to_owned(), "prod".to_owned())];
        let attrs = attributes("edge", &configured, Some("node-7"));
        assert_eq!(attrs[0], ("service.name".to_owned(), "edge".to_owned()));
        assert!(!attrs.iter().any(|(_, v)| v == "ignored"));
        assert!(attrs.contains(&("env".to_owned(), "prod".to_owned())));
        assert!(attrs.iter().any(|(k, _)| k == "host.name"));
        assert!(attrs.contains(&("k8s.node.name".to_owned(), "node-7".to_owned())));
    }
}
