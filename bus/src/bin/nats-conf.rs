//! `nats-conf WORKER...`: prints the nats-server configuration of
//! Switchyard's users and their subject permissions
//! ([`bus::permissions`]) for these workers (`NAME` or `NAME.RANK`),
//! passwords read from `SWITCHYARD_NATS_PASSWORD_*` variables.

use anyhow::Context as _;
use protocol::WorkerId;

fn main() -> anyhow::Result<()> {
    let workers = std::env::args()
        .skip(1)
        .map(|arg| {
            arg.parse::<WorkerId>()
                .with_context(|| format!("{arg:?} is not a worker (NAME or NAME.RANK)"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if workers.is_empty() {
        anyhow::bail!("usage: nats-conf WORKER... (each NAME or NAME.RANK)");
    }
    print!(
        "{}",
        bus::permissions::nats_server_config(
            &workers,
            bus::permissions::Passwords::FromEnvironment
        )
    );
    Ok(())
}
