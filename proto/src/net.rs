//! Small pieces every server shares.

use std::net::SocketAddr;
use std::path::Path;

/// Writes `addr` to `path` atomically (temp file + rename), so a watcher polling for the
/// file never reads half an address. Used with `--addr-file` when binding port 0.
pub fn write_addr_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, addr.to_string())?;
    std::fs::rename(&tmp, path)
}
