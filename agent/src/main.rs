//! The `tracetap` binary: parse the configuration (exit 2 on a bad value), load the probes
//! (exit 1 with what is missing), then capture, export and serve the admin endpoint until
//! SIGTERM or SIGINT, flushing queued spans within the export timeout.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use anyhow::Context as _;
use tracetap::capture::pods::Pods;
use tracetap::capture::{self, Output, loader::Probes};
use tracetap::cli::{self, Command};
use tracetap::config::Config;
use tracetap::export::{self, BatchQueue, Destination};
use tracetap::k8s::{self, PodIndex};
use tracetap::metrics::Metrics;
use tracetap::tail::engine::Limits;
use tracetap::tail::policy::{NamedPolicy, PolicySet};
use tracetap::tail::{self, PolicySource, TailConfig, policy_file};
use tracetap::{admin, config, snippet, telemetry};
use tracetap_storage::SledOptions;

fn main() -> ExitCode {
    match cli::parse(std::env::args_os().skip(1)) {
        Ok(Command::Run) => {}
        Ok(Command::Help) => {
            print_help();
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("tracetap {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Ok(Command::SnippetHelp) => {
            println!("{}", cli::SNIPPET_USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Command::Snippet(options)) => {
            return match snippet::from_lookup(|k| std::env::var(k).ok(), options) {
                Ok(lines) => {
                    print!("{lines}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("tracetap haproxy-snippet: {e}");
                    ExitCode::from(2)
                }
            };
        }
        Ok(Command::View(file)) => return view(file.as_deref()),
        Err(e) => {
            eprintln!("tracetap: {e}\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(errors) => {
            for e in &errors.0 {
                eprintln!("tracetap: configuration error: {e}");
            }
            return ExitCode::from(2);
        }
    };
    init_logging(&config.log_filter);
    let prepared = Destination::new(&config.export).and_then(|d| Ok((d, telemetry::Prepared::new(&config.telemetry)?)));
    let (destination, own_telemetry) = match prepared {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tracetap: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let policies = match config.tail.as_ref().map(load_policies).transpose() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tracetap: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&config, policies, destination, own_telemetry) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tracetap: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_help() {
    println!("tracetap {}: traces HAProxy from the outside with eBPF.\n", env!("CARGO_PKG_VERSION"));
    println!("{}\n", cli::USAGE);
    println!("Configured with environment variables:");
    for (var, default, meaning) in config::VARIABLES {
        println!("  {var:<36} default {default}\n  {:<36} {meaning}", "");
    }
}

fn init_logging(filter: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a terminal: a log file or a container's log keeps plain text.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(colours).init();
}

/// Reads and validates the tail policies (the file is read once, at start).
fn load_policies(tail: &TailConfig) -> Result<Vec<NamedPolicy>, String> {
    match &tail.policies {
        PolicySource::Env(policies) => Ok(policies.clone()),
        PolicySource::File(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("TRACETAP_TAIL_POLICY_FILE={}: cannot read it: {e}", path.display()))?;
            policy_file::parse(&text).map_err(|e| format!("TRACETAP_TAIL_POLICY_FILE={}: {e}", path.display()))
        }
    }
}

/// Opens the tail store and starts the tail thread; returns the capture thread's output.
fn start_tail(
    config: &Config,
    tail: &TailConfig,
    policies: Vec<NamedPolicy>,
    export_queue: BatchQueue,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Output, std::thread::JoinHandle<()>)> {
    std::fs::create_dir_all(&tail.state_dir)
        .with_context(|| format!("creating TRACETAP_STATE_DIR={}", tail.state_dir.display()))?;
    let limits = Limits {
        grace_ns: tail.grace.as_nanos() as u64,
        decision_wait_ns: tail.decision_wait.as_nanos() as u64,
        max_disk_bytes: tail.max_disk_bytes,
        decision_cache: tail.decision_cache,
        export_batch_spans: config.max_export_batch_size,
        spill_after_ns: tail.spill_after.as_nanos() as u64,
        max_memory_bytes: tail.max_memory_bytes,
    };
    let (queue, input) =
        tail::queue((config.max_queue_size / config.max_export_batch_size).max(2), Arc::clone(metrics));
    let (metrics, ack_wait) = (Arc::clone(metrics), config.export.timeout);
    let (state_dir, resource, policies) = (tail.state_dir.clone(), config.resource(), PolicySet::new(policies));
    let journal = tail.journal;
    let thread = std::thread::Builder::new()
        .name("tail".into())
        .spawn(move || {
            // Recovery reads the whole store: it runs here, while the admin endpoint already
            // answers, and the capture thread's batches wait in (or are shed from) the tail queue.
            let opened = tail::store::open_engine(
                &state_dir,
                SledOptions::default(),
                journal,
                &policies,
                limits,
                &resource,
                &metrics,
            );
            match opened {
                Some(engine) => {
                    tracing::info!(
                        pending = engine.pending_traces(),
                        resent = engine.resent_traces(),
                        dir = %state_dir.display(),
                        "tail store open"
                    );
                    tail::run(engine, &input, &export_queue, &metrics, ack_wait);
                }
                None => tail::run_without_store(&input, &metrics),
            }
        })
        .context("starting the tail thread")?;
    Ok((Output::Tail(queue), thread))
}

/// Starts the watch of this node's pods when `NODE_NAME` is set and a cluster configuration is
/// found; `None` (everything Kubernetes off; a warning when a configuration is there but unusable)
/// otherwise.
fn start_pod_watch(runtime: &tokio::runtime::Runtime, config: &Config, metrics: &Arc<Metrics>) -> Option<PodIndex> {
    let node = config.node_name.clone()?;
    let client = match runtime.block_on(k8s::client()) {
        Ok(Some(client)) => Some(client),
        Ok(None) => {
            tracing::info!(node, "no Kubernetes cluster configuration: pod names off, cgroup ids only");
            None
        }
        Err(error) => {
            tracing::warn!(
                node,
                %error,
                "the Kubernetes cluster configuration (KUBECONFIG or the in-cluster service account) is unusable: pod names off, cgroup ids only"
            );
            None
        }
    };
    let Some(client) = client else {
        if config.pod_selector.is_some() {
            tracing::warn!("TRACETAP_K8S_POD_SELECTOR is set but pods cannot be known: nothing will be traced");
        }
        return None;
    };
    let index = PodIndex::default();
    runtime.spawn(k8s::watch(client, node.clone(), Arc::clone(&index), Arc::clone(metrics)));
    tracing::info!(node, "watching this node's pods");
    Some(index)
}

/// Loads and attaches the probes, and says how the TLS probes attach.
fn start_probes(config: &Config, metrics: &Metrics, destination: &Destination) -> anyhow::Result<Probes> {
    let probes = Probes::load(config).context("starting the eBPF probes")?;
    tracing::info!(
        programs = probes.attached,
        admin = %config.admin_addr,
        sink = destination.describe(),
        "probes attached"
    );
    match probes.tls.route() {
        Ok(route) => tracing::info!(%route, "TLS probes attach through {route}"),
        Err(why) if probes.tls.captures() => tracing::warn!("{why}"),
        Err(_) => {}
    }
    let _ = metrics.tls_route.set(match probes.tls.route() {
        Ok(route) => format!("tls: {route}"),
        Err(why) => format!("tls: none: {why}"),
    });
    Ok(probes)
}

fn run(
    config: &Config,
    policies: Option<Vec<NamedPolicy>>,
    destination: Destination,
    own_telemetry: Option<telemetry::Prepared>,
) -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    let metrics = Arc::new(Metrics::default());
    let admin_listener = runtime
        .block_on(tokio::net::TcpListener::bind(config.admin_addr))
        .with_context(|| format!("binding TRACETAP_ADMIN_ADDR={}", config.admin_addr))?;
    // A sampler that keeps no request needs no probes: none are loaded, and HAProxy runs untraced.
    let probes = if config.sampler.keeps_nothing() {
        tracing::info!(
            admin = %config.admin_addr,
            "OTEL_TRACES_SAMPLER keeps no trace: the probes are not loaded and HAProxy runs untraced (a sampled flag \
             that HAProxy's lines forward is not followed either)"
        );
        let _ = metrics.tls_route.set("tls: none: the sampler keeps no trace".into());
        metrics.ready.store(true, Relaxed);
        None
    } else {
        Some(start_probes(config, &metrics, &destination)?)
    };
    let (queue, rx) = export::queue(config.max_queue_size, config.max_export_batch_size, Arc::clone(&metrics));
    let (output, tail_thread) = match (&config.tail, policies) {
        (Some(tail), Some(policies)) => {
            let (output, thread) = start_tail(config, tail, policies, queue, &metrics)?;
            (output, Some(thread))
        }
        _ => (Output::Export(queue), None),
    };
    let stop = Arc::new(AtomicBool::new(false));
    // Without probes, nothing feeds the queue: its sender is held until shutdown, as the capture
    // thread would hold it, so that the tail and export threads end at the same point.
    let (capture_thread, idle_output) = match probes {
        Some(probes) => {
            let pod_index = start_pod_watch(&runtime, config, &metrics);
            let pods = Pods::new("/proc".into(), pod_index, config.pod_selector.clone(), config.service_name.clone());
            let (config, metrics, stop) = (config.clone(), Arc::clone(&metrics), Arc::clone(&stop));
            let thread = std::thread::Builder::new()
                .name("capture".into())
                .spawn(move || capture::run(probes, &config, &metrics, output, pods, &stop))
                .context("starting the capture thread")?;
            (Some(thread), None)
        }
        None => (None, Some(output)),
    };

    // The exporter has a thread and a runtime of its own: whatever an export costs (TLS, gzip,
    // tonic's compression, a slow stdout) never delays the admin endpoint's answers.
    let (exported_tx, exported_rx) = tokio::sync::oneshot::channel::<()>();
    let exporter = {
        let (metrics, stop) = (Arc::clone(&metrics), Arc::clone(&stop));
        let export_runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the export runtime")?;
        std::thread::Builder::new()
            .name("export".into())
            .spawn(move || {
                export_runtime.block_on(export::run(destination, rx, metrics, stop));
                let _ = exported_tx.send(());
            })
            .context("starting the export thread")?
    };

    let own_telemetry = match own_telemetry {
        None => None,
        Some(prepared) => {
            tracing::info!(endpoint = prepared.describe(), "exporting the agent's own metrics over OTLP");
            Some(prepared.start(runtime.handle(), config.resource(), &metrics)?)
        }
    };

    runtime.block_on(async {
        let admin = tokio::spawn(admin::serve(
            admin_listener,
            Arc::clone(&metrics),
            admin::Limits::default(),
            config.telemetry.prometheus,
        ));
        wait_for_signal().await;
        tracing::info!("shutting down: flushing queued spans");
        stop.store(true, Relaxed);
        // The capture thread drops its queue sender when it returns, which ends the tail thread (if
        // any), whose end ends the exporter.
        if let Some(capture_thread) = capture_thread {
            let _ = tokio::task::spawn_blocking(move || capture_thread.join()).await;
        }
        drop(idle_output);
        if let Some(tail_thread) = tail_thread {
            // Its hand-over waits for room in the export queue: with the exporter stuck (a
            // collector mid-retry, a stdout nobody reads) that wait is bounded here.
            let joined = tokio::task::spawn_blocking(move || tail_thread.join());
            if tokio::time::timeout(config.export.timeout, joined).await.is_err() {
                tracing::warn!(
                    "the tail thread did not hand over its last kept traces within OTEL_EXPORTER_OTLP_TIMEOUT; they stay in the store's outbox and are exported at the next start"
                );
            }
        }
        if tokio::time::timeout(config.export.timeout, exported_rx).await.is_err() {
            tracing::warn!("flush did not finish within OTEL_EXPORTER_OTLP_TIMEOUT; queued spans were dropped");
        } else {
            let _ = exporter.join();
        }
        if let Some(own_telemetry) = own_telemetry {
            // Off the runtime: the last export's connection runs on it.
            let _ = tokio::task::spawn_blocking(move || own_telemetry.shutdown()).await;
        }
        admin.abort();
    });
    Ok(())
}

/// `tracetap view [FILE]`: exits 1 when the input cannot be read, 0 otherwise (lines that are
/// not spans are counted on standard error).
fn view(file: Option<&std::path::Path>) -> ExitCode {
    let rendered = match file {
        Some(path) => std::fs::File::open(path).and_then(|f| tracetap::view::render(std::io::BufReader::new(f))),
        None => tracetap::view::render(std::io::stdin().lock()),
    };
    let what = file.map_or_else(|| "standard input".to_owned(), |p| p.display().to_string());
    match rendered {
        Ok((text, read)) => {
            use std::io::Write as _;
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            if read.skipped > 0 {
                eprintln!("tracetap view: {} line(s) of {what} were not spans; skipped", read.skipped);
            }
            if read.spans == 0 {
                eprintln!("tracetap view: no spans in {what}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tracetap view: cannot read {what}: {e}");
            ExitCode::from(1)
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
