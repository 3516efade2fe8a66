//! `gantry auth token`: mints a random bearer token and prints the `[[auth.tokens]]`
//! lines for it; gantry.toml holds only the token's SHA-256.

use std::io::Read;

#[derive(clap::Subcommand)]
pub enum AuthCommand {
    /// Mint a random token: prints the token (give it to the client) and the config lines
    /// with its SHA-256 (put them in gantry.toml).
    Token(TokenArgs),
}

#[derive(clap::Args)]
pub struct TokenArgs {
    /// The token's name in logs and refusals.
    #[arg(long, default_value = "client")]
    name: String,
    /// Grants it has (repeatable), names of `[auth.grants.*]`.
    #[arg(long = "grant")]
    grants: Vec<String>,
    /// A worker credential (`[[auth.workers.tokens]]`) instead of a client one.
    #[arg(long)]
    worker: bool,
}

pub fn run(cmd: AuthCommand) -> anyhow::Result<()> {
    let AuthCommand::Token(a) = cmd;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    let token = hex::encode(bytes);
    let sha = gantry_services::auth::token_sha256(&token);
    println!("# token (give it to the client; it is shown only now): {token}");
    if a.worker {
        println!("[[auth.workers.tokens]]\nname = {:?}\nsha256 = \"{sha}\"", a.name);
    } else {
        let grants = a.grants.iter().map(|g| format!("{g:?}")).collect::<Vec<_>>().join(", ");
        println!("[[auth.tokens]]\nname = {:?}\nsha256 = \"{sha}\"\ngrants = [{grants}]", a.name);
    }
    Ok(())
}
