//! The `tracetap` binary: parse the configuration (exit 2 on a bad value), load the probes
//! (exit 1 with what is missing), then capture, export and serve the admin endpoint until
//! SIGTERM or SIGINT, flushing queued spans within the export timeout.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use anyhow::Context as _;
use tracetap::capture::{self, loader::Probes};
use tracetap::config::{Config, Sink};
use tracetap::export;
use tracetap::metrics::Metrics;
use tracetap::{admin, config};

fn main() -> ExitCode {
    if std::env::args().nth(1).is_some_and(|a| a == "--help" || a == "-h") {
        print_help();
        return ExitCode::SUCCESS;
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tracetap: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging(&config.log_filter);
    match run(&config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tracetap: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_help() {
    println!("tracetap {}: traces HAProxy from the outside with eBPF.\n", env!("CARGO_PKG_VERSION"));
    println!("Configured with environment variables:");
    for (var, default, meaning) in config::VARIABLES {
        println!("  {var:<36} default {default}\n  {:<36} {meaning}", "");
    }
}

fn init_logging(filter: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

fn run(config: &Config) -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    let metrics = Arc::new(Metrics::default());
    let admin_listener = runtime
        .block_on(tokio::net::TcpListener::bind(config.admin_addr))
        .with_context(|| format!("binding TRACETAP_ADMIN_ADDR={}", config.admin_addr))?;
    let probes = Probes::load(config).context("starting the eBPF probes")?;
    tracing::info!(
        programs = probes.attached,
        admin = %config.admin_addr,
        sink = match &config.sink { Sink::Stdout => "stdout".to_owned(), Sink::OtlpHttp(e) => e.to_string() },
        "probes attached"
    );

    let (queue, rx) = export::queue(config.max_queue_size, config.max_export_batch_size, Arc::clone(&metrics));
    let stop = Arc::new(AtomicBool::new(false));
    let capture_thread = {
        let (config, metrics, stop) = (config.clone(), Arc::clone(&metrics), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("capture".into())
            .spawn(move || capture::run(probes, &config, &metrics, queue, &stop))
            .context("starting the capture thread")?
    };

    runtime.block_on(async {
        let exporter = tokio::spawn(export::run(config.clone(), rx, Arc::clone(&metrics)));
        let admin = tokio::spawn(admin::serve(admin_listener, Arc::clone(&metrics)));
        wait_for_signal().await;
        tracing::info!("shutting down: flushing queued spans");
        stop.store(true, Relaxed);
        // The capture thread drops the queue sender when it returns, which ends the exporter.
        let _ = tokio::task::spawn_blocking(move || capture_thread.join()).await;
        if tokio::time::timeout(config.export_timeout, exporter).await.is_err() {
            tracing::warn!("flush did not finish within OTEL_EXPORTER_OTLP_TIMEOUT; queued spans were dropped");
        }
        admin.abort();
    });
    Ok(())
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
