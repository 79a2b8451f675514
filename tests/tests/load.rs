//! Linking accuracy under load: 64 concurrent keep-alive clients, random paths, half with a
//! traceparent, HAProxy with `nbthread 4` and `http-reuse always`, 20 000+ requests. Every request
//! must be accounted for and at least 99.9% of CLIENT spans must sit under the SERVER span of the
//! request that caused them. Needs root.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracetap_tests::client::Conn;
use tracetap_tests::{Stack, haproxy, require_root, wait_for};

const CLIENTS: u64 = 64;
const PER_CLIENT: u64 = 320;

#[test]
fn links_stay_right_under_concurrency() {
    if !require_root() {
        return;
    }
    let s = Stack::with_config(
        |port, backend| {
            haproxy::config(port, &[backend], "")
                .replace("global\n", "global\n    nbthread 4\n")
                .replace("\nbackend be_app\n", "\nbackend be_app\n    http-reuse always\n")
        },
        // A ring that holds the whole burst: the suite runs tests in parallel on two CPUs, and
        // the agent shares them with three HAProxy processes, the clients and the receiver.
        &[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "65536".to_owned()),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048".to_owned()),
            ("TRACETAP_RING_BYTES", (64 << 20).to_string()),
        ],
    );
    let front = s.front;
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let failed = Arc::clone(&failed);
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(c);
                let mut conn = Conn::connect(front).expect("connect");
                for r in 0..PER_CLIENT {
                    let id = c * PER_CLIENT + r;
                    let path =
                        format!("/{}/{}?id={id}", ["api", "img", "cart", "user"][rng.usize(..4)], rng.u32(..1000));
                    let tp = format!("00-{:032x}-{:016x}-01", u128::from(id) + 1, id + 1);
                    let headers: &[(&str, &str)] = if id.is_multiple_of(2) { &[("traceparent", &tp)] } else { &[] };
                    match conn.get(&path, headers) {
                        Ok(resp) if resp.status == 200 => {}
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            conn = Conn::connect(front).expect("reconnect");
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("client thread");
    }
    let elapsed = started.elapsed();
    let sent = CLIENTS * PER_CLIENT;
    let failed = failed.load(Ordering::Relaxed);
    let answered = sent - failed;

    let spans = wait_for(Duration::from_mins(1), || {
        let all = s.receiver.spans();
        (all.iter().filter(|x| x.is_server()).count() as u64 >= answered).then_some(all)
    })
    .unwrap_or_else(|| s.receiver.spans());
    let servers: Vec<_> = spans.iter().filter(|x| x.is_server()).collect();
    let mut by_parent: HashMap<&[u8], Vec<_>> = HashMap::new();
    for c in spans.iter().filter(|x| x.is_client()) {
        by_parent.entry(&c.span.parent_span_id[..]).or_default().push(c);
    }
    let mut right = 0u64;
    let mut wrong = 0u64;
    let mut traceparent_kept = 0u64;
    for server in &servers {
        let query = server.str_attr("url.query");
        match by_parent.get(&server.span.span_id[..]).map(Vec::as_slice) {
            Some([client]) if client.str_attr("url.query") == query => right += 1,
            _ => wrong += 1,
        }
        let Some(id) = query.and_then(|q| q.strip_prefix("id=")).and_then(|v| v.parse::<u64>().ok()) else {
            eprintln!(
                "SERVER span without a request id: {} {:?} status {:?}",
                server.span.name,
                server.str_attr("url.path"),
                server.int_attr("http.response.status_code")
            );
            continue;
        };
        if id % 2 == 0 && server.span.trace_id == (u128::from(id) + 1).to_be_bytes() {
            traceparent_kept += 1;
        }
    }
    let lost_ring = s.agent.metric("tracetap_events_lost_ring_full_total");
    let dropped_queue = s.agent.metric("tracetap_spans_dropped_queue_full_total");
    let dropped_export = s.agent.metric("tracetap_spans_dropped_export_failed_total");
    let unlinked = s.agent.metric("tracetap_backend_requests_unlinked_total");
    let expired = s.agent.metric("tracetap_exchanges_expired_total");
    println!(
        "[load] sent {sent} ({failed} failed) in {elapsed:.1?}; SERVER spans {}; links right {right}, wrong {wrong} ({:.3}%); \
         traceparent kept {traceparent_kept}/{}; ring losses {lost_ring}; queue drops {dropped_queue}; export drops {dropped_export}; \
         unlinked backend requests {unlinked}; expired {expired}",
        servers.len(),
        100.0 * right as f64 / servers.len().max(1) as f64,
        sent / 2,
    );
    assert!(sent >= 20_000);
    assert_eq!(failed, 0, "HAProxy answered every request");
    // Every request is accounted for: a SERVER span, or a counted drop.
    let counted_drops = lost_ring + dropped_queue + dropped_export + expired;
    assert!(servers.len() as u64 + counted_drops >= answered, "requests unaccounted for");
    assert_eq!(servers.len() as u64, answered, "no drops expected on this load");
    assert!(right * 1000 >= 999 * servers.len() as u64, "at least 99.9% of links right");
    assert_eq!(traceparent_kept, sent / 2, "every incoming traceparent continued");
}
