//! Records lost on purpose: a ring buffer far too small for the traffic. Gaps must be counted, no
//! exported span may pair a request with another request's response, and no CLIENT span may sit
//! under another request's SERVER span. Needs root (see `require_root`).

use std::collections::HashMap;
use std::time::Duration;

use tracetap_tests::client::Conn;
use tracetap_tests::{Stack, require_root, wait_for};

const CLIENTS: usize = 16;
const REQUESTS: usize = 60;

/// The status a request asked for, from its path `/ov/{client}/{n}/{status}`.
fn wanted(path: &str) -> Option<i64> {
    path.rsplit('/').next()?.parse().ok()
}

#[test]
fn forced_ring_overflow_counts_gaps_and_exports_no_mispaired_span() {
    if !require_root() {
        return;
    }
    let s = Stack::start(
        "",
        &[("TRACETAP_RING_BYTES", "65536".to_owned()), ("TRACETAP_CAPTURE_BYTES", "16384".to_owned())],
    );
    let pad = "p".repeat(9000);
    let front = s.front;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let pad = pad.clone();
            std::thread::spawn(move || {
                let mut conn = Conn::connect(front).expect("connect");
                for n in 0..REQUESTS {
                    // A status of its own per request among the concurrent ones.
                    let status = 200 + (c + CLIENTS * (n % 5)) as u16;
                    let status = match status {
                        204 => 296,
                        205 => 297,
                        s => s,
                    };
                    let path = format!("/ov/{c}/{n}/{status}");
                    let code = status.to_string();
                    let got = conn.get(&path, &[("x-want-status", &code), ("x-pad", &pad)]).expect("request");
                    assert_eq!(got.status, status);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    // A marker after the load, on a fresh connection: once its span is out, everything before it
    // has been processed.
    let mut marker = Conn::connect(s.front).unwrap();
    assert_eq!(marker.get("/marker", &[]).unwrap().status, 200);
    let spans = wait_for(Duration::from_mins(1), || {
        let all = s.receiver.spans();
        all.iter().any(|x| x.is_server() && x.str_attr("url.path") == Some("/marker")).then_some(all)
    })
    .unwrap_or_else(|| panic!("the marker's span never came\n{}", s.agent.log()));

    let servers: HashMap<&[u8], &tracetap_tests::otlp::Received> =
        spans.iter().filter(|x| x.is_server()).map(|x| (x.span.span_id.as_slice(), x)).collect();
    let mut checked = 0;
    let mut mispaired = Vec::new();
    let mut mislinked = Vec::new();
    for span in spans.iter().filter(|x| x.is_server()) {
        let Some(want) = span.str_attr("url.path").and_then(wanted) else { continue };
        if let Some(got) = span.int_attr("http.response.status_code") {
            checked += 1;
            if got != want {
                mispaired.push(format!("SERVER {:?} got {got}", span.str_attr("url.path")));
            }
        }
    }
    for span in spans.iter().filter(|x| x.is_client()) {
        let Some(parent) = servers.get(span.span.parent_span_id.as_slice()) else {
            mispaired.push("CLIENT span without its SERVER span".to_owned());
            continue;
        };
        let Some(want) = parent.str_attr("url.path").and_then(wanted) else { continue };
        if span.str_attr("url.path") != parent.str_attr("url.path") {
            mislinked.push(format!(
                "CLIENT {:?} under SERVER {:?}",
                span.str_attr("url.path"),
                parent.str_attr("url.path")
            ));
        }
        // Pairing: a CLIENT span's response is the answer to its own request.
        let own = span.str_attr("url.path").and_then(wanted).unwrap_or(want);
        if let Some(got) = span.int_attr("http.response.status_code") {
            checked += 1;
            if got != own {
                mispaired.push(format!("CLIENT {:?} got {got}", span.str_attr("url.path")));
            }
        }
    }
    // Loss counters are published every 250 ms.
    let lost = wait_for(Duration::from_secs(5), || {
        let n = s.agent.metric("tracetap_events_lost_ring_full_total");
        (n > 0).then_some(n)
    })
    .unwrap_or(0);
    let gaps = s.agent.metric("tracetap_capture_gaps_total");
    let gap_exchanges = s.agent.metric("tracetap_capture_gap_exchanges_total");
    eprintln!(
        "scenario=forced_ring_overflow requests={} spans={} status_checked={checked} mispaired={} mislinked={} ring_full_losses={lost} capture_gaps={gaps} gap_exchanges={gap_exchanges} mislinks={mislinked:?}",
        CLIENTS * REQUESTS,
        spans.len(),
        mispaired.len(),
        mislinked.len()
    );
    assert!(lost > 0, "the ring was meant to overflow: make the load heavier");
    assert!(gaps > 0, "losses on traced connections must show as gaps");
    assert!(checked > 0, "some spans must still be exported");
    assert!(mispaired.is_empty(), "mispaired spans exported: {mispaired:?}");
    assert!(mislinked.is_empty(), "CLIENT spans under another request's SERVER span: {mislinked:?}");
}
