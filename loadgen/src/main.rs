//! `loadgen`: drives router replicas (the agentic workload, or a fixed-rate
//! `/v1/route` benchmark) and measures the event pipeline.

mod agentic;
mod api_key;
mod events_bench;
mod overhead;
mod ready_bench;
mod route_bench;
mod sink;
mod stats;

use std::time::Duration;

use clap::{Parser, Subcommand};
use sim::workload::AgenticConfig;

#[derive(Debug, Parser)]
#[command(version, about = "Load generator and benchmarks for Switchyard")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Agentic sessions (the simulator's workload) in real time against
    /// router replicas; prints a JSON summary.
    Agentic {
        /// Router base URLs, e.g. http://127.0.0.1:8080 (requests are spread over them).
        #[arg(
            long,
            env = "SWITCHYARD_ROUTERS",
            value_delimiter = ',',
            required = true
        )]
        routers: Vec<String>,
        #[arg(long, default_value_t = 0.5)]
        sessions_per_s: f64,
        #[arg(long, default_value_t = 30.0)]
        duration_s: f64,
        /// Runs the workload's clock faster (think times, arrivals).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        #[arg(long, default_value_t = 256)]
        max_output_tokens: u32,
        #[arg(long, default_value_t = 120)]
        request_timeout_s: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The routers' API key (`Authorization: Bearer KEY`).
        #[arg(long, env = "SWITCHYARD_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Times a turn is sent again, through the next router, when it got
        /// no response (connection refused, reset) or a 429 or 503 with
        /// `Retry-After` (waited, at most 10 s), as the `openai` client
        /// does (twice by default).
        #[arg(long, visible_alias = "connect-retries", default_value_t = agentic::Retries::default().request)]
        request_retries: u32,
        /// Times a turn is sent again, from the start and through the next
        /// router, when its stream was cut by a transport error once its
        /// response began (its router died), as agent clients do (Codex
        /// reconnects a dropped stream up to 5 times). An error the router
        /// sends in the stream is never retried.
        #[arg(long, default_value_t = agentic::Retries::default().stream)]
        stream_retries: u32,
    },
    /// `/v1/route` at fixed rates (open loop); one JSON line per rate.
    Route {
        #[arg(
            long,
            env = "SWITCHYARD_ROUTER",
            default_value = "http://127.0.0.1:8080"
        )]
        router: String,
        /// Requests per second, tried in order until p99 exceeds --stop-above-p99-ms.
        #[arg(long, value_delimiter = ',', default_value = "1000,2000,5000")]
        rates: Vec<f64>,
        #[arg(long, default_value_t = 10.0)]
        duration_s: f64,
        #[arg(long, default_value_t = 8192)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 256)]
        distinct: usize,
        #[arg(long, default_value_t = 256)]
        max_in_flight: usize,
        /// Rounds per rate: the figures are the rounds' medians.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long, default_value_t = 5.0)]
        stop_above_p99_ms: f64,
        /// The routers' API key (`Authorization: Bearer KEY`).
        #[arg(long, env = "SWITCHYARD_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
    },
    /// An HTTP server that reads each `/v1/route` body and answers `{}`:
    /// run `route` against it for the floor of the route benchmark (the
    /// load generator, loopback HTTP and the machine, without a router).
    Sink {
        #[arg(long, default_value = "127.0.0.1:8090")]
        http_addr: std::net::SocketAddr,
    },
    /// Publishes KV batches as simulated agents and follows the resulting
    /// deltas as a router does (a kv-indexer must be running); prints the
    /// publish-to-router-view delay and the pipeline's throughput.
    Events {
        #[command(flatten)]
        servers: Servers,
        #[arg(long, default_value_t = 16)]
        workers: usize,
        #[arg(long, default_value_t = 32)]
        blocks_per_batch: usize,
        #[arg(long, default_value_t = 100_000.0)]
        block_events_per_s: f64,
        #[arg(long, default_value_t = 10.0)]
        duration_s: f64,
    },
    /// Times a new router replica from spawn to ready, after writing a
    /// snapshot of --blocks blocks (run against a fresh NATS without a
    /// kv-indexer).
    Ready {
        #[command(flatten)]
        servers: Servers,
        /// The router binary, e.g. target/release/router.
        #[arg(long)]
        router_bin: String,
        #[arg(long, default_value_t = 1_000_000)]
        blocks: usize,
        #[arg(long, default_value_t = 18_080)]
        port: u16,
    },
    /// The router's latency overhead over calling the worker directly.
    Overhead {
        #[arg(
            long,
            env = "SWITCHYARD_ROUTER",
            default_value = "http://127.0.0.1:8080"
        )]
        router: String,
        #[arg(
            long,
            env = "SWITCHYARD_NATS_URL",
            default_value = "nats://127.0.0.1:4222"
        )]
        nats: String,
        /// NATS credentials and TLS.
        #[command(flatten)]
        auth: bus::AuthArgs,
        #[arg(long, default_value_t = 200)]
        requests: usize,
        #[arg(long, default_value_t = 256)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 4)]
        max_tokens: u32,
        /// The routers' API key (`Authorization: Bearer KEY`).
        #[arg(long, env = "SWITCHYARD_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
    },
}

/// The NATS server and etcd of the system under test.
#[derive(Debug, clap::Args)]
struct Servers {
    /// NATS servers, comma separated (one cluster's).
    #[arg(
        long,
        env = "SWITCHYARD_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats: String,
    /// etcd endpoints, comma separated. Simulated workers register here
    /// (the indexer drops workers etcd does not list).
    #[arg(
        long,
        env = "SWITCHYARD_ETCD_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    etcd: Vec<String>,
    /// Credentials and TLS for both.
    #[command(flatten)]
    auth: bus::AuthArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "loadgen=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Agentic {
            routers,
            sessions_per_s,
            duration_s,
            time_scale,
            max_output_tokens,
            request_timeout_s,
            seed,
            api_key,
            request_retries,
            stream_retries,
        } => {
            let summary = agentic::run(agentic::AgenticRun {
                retries: agentic::Retries {
                    request: request_retries,
                    stream: stream_retries,
                },
                routers,
                workload: AgenticConfig {
                    sessions_per_s,
                    duration_s,
                    seed,
                    ..AgenticConfig::default()
                },
                time_scale,
                max_output_tokens,
                request_timeout: Duration::from_secs(request_timeout_s),
                api_key,
            })
            .await?;
            println!("{summary}");
        }
        Command::Route {
            router,
            rates,
            duration_s,
            prompt_tokens,
            distinct,
            max_in_flight,
            rounds,
            stop_above_p99_ms,
            api_key,
        } => {
            let lines = route_bench::run(route_bench::RouteBench {
                router,
                rates,
                duration: Duration::from_secs_f64(duration_s),
                prompt_tokens,
                distinct,
                max_in_flight,
                rounds,
                stop_above_p99_ms,
                api_key,
            })
            .await?;
            for line in lines {
                println!("{line}");
            }
        }
        Command::Sink { http_addr } => sink::run(http_addr).await?,
        Command::Events {
            servers: Servers { nats, etcd, auth },
            workers,
            blocks_per_batch,
            block_events_per_s,
            duration_s,
        } => {
            let summary = events_bench::run(events_bench::EventsBench {
                nats,
                etcd,
                auth,
                workers,
                blocks_per_batch,
                block_events_per_s,
                duration: Duration::from_secs_f64(duration_s),
            })
            .await?;
            println!("{summary}");
        }
        Command::Ready {
            servers: Servers { nats, etcd, auth },
            router_bin,
            blocks,
            port,
        } => {
            let summary = ready_bench::run(ready_bench::ReadyBench {
                nats,
                etcd,
                auth,
                router_bin,
                blocks,
                port,
            })
            .await?;
            println!("{summary}");
        }
        Command::Overhead {
            router,
            nats,
            auth,
            requests,
            prompt_tokens,
            max_tokens,
            api_key,
        } => {
            let summary = overhead::run(overhead::Overhead {
                router,
                nats,
                auth,
                requests,
                prompt_tokens,
                max_tokens,
                api_key,
            })
            .await?;
            println!("{summary}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
