//! The rooms of src/models (`arch`, `load`, `blocks`, `runtime`, `text`, in that order)
//! import only from themselves and the rooms before them, so the layers cannot grow a
//! cycle. A room is named by a path through `crate::models` (also inside a
//! `crate::models::{..}` group) or through `super::`; code after the first
//! `#[cfg(test)]` of a file and comment lines are not read.

use std::path::{Path, PathBuf};

/// The rooms, each allowed to import itself and the rooms before it.
const ROOMS: [&str; 5] = ["arch", "load", "blocks", "runtime", "text"];

/// The identifiers at the top level of the `{..}` group that `s` starts with (the first
/// one of each item: `arch` for `arch::Config`).
fn group_heads(s: &str) -> Vec<&str> {
    let mut depth = 0usize;
    let mut heads = Vec::new();
    let mut item_start = Some(1);
    for (i, c) in s.char_indices() {
        match c {
            '{' => {
                depth += 1;
                continue;
            }
            '}' if depth == 1 => break,
            '}' => depth -= 1,
            ',' if depth == 1 => item_start = Some(i + 1),
            _ => {}
        }
        if depth == 1 {
            if let Some(start) = item_start.take() {
                heads.push(ident(s[start..].trim_start()));
            }
        }
    }
    heads.retain(|h| !h.is_empty());
    heads
}

/// The identifier `s` starts with (empty if none).
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The names a path names after `rest` (`x` of `x::..`, or each head of a `{..}` group).
fn names_after(rest: &str) -> Vec<&str> {
    if rest.starts_with('{') {
        group_heads(rest)
    } else {
        vec![ident(rest)]
    }
}

/// The rooms that `code` of the module `module` (its path below `crate`, e.g.
/// `["models", "load", "gguf"]`) names outside its tests and comments.
fn rooms_named(module: &[&str], code: &str) -> Vec<String> {
    let code = code.split("#[cfg(test)]").next().unwrap_or("");
    let code: String = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut rooms = Vec::new();
    for (at, _) in code.match_indices("crate::models::") {
        rooms.extend(names_after(&code[at + "crate::models::".len()..]));
    }
    for (at, _) in code.match_indices("super::") {
        // Only the start of a `super::super::..` chain.
        if code[..at].ends_with("super::") {
            continue;
        }
        let mut rest = &code[at..];
        let mut base = module.to_vec();
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        if base == ["models"] {
            rooms.extend(names_after(rest));
        }
    }
    let mut rooms: Vec<String> = rooms
        .into_iter()
        .filter(|r| ROOMS.contains(r))
        .map(String::from)
        .collect();
    rooms.sort();
    rooms.dedup();
    rooms
}

/// The imports of `code` (module `module`, in room `room`) from rooms after `room`.
fn later_rooms(room: &str, module: &[&str], code: &str) -> Vec<String> {
    let rank = |r: &str| ROOMS.iter().position(|x| *x == r).expect("a room");
    rooms_named(module, code)
        .into_iter()
        .filter(|r| rank(r) > rank(room))
        .collect()
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

#[test]
fn rooms_import_only_earlier_rooms() {
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/models");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for path in rust_files(&models) {
        let rel = path.strip_prefix(&models).expect("under src/models");
        let parts: Vec<&str> = rel.iter().map(|p| p.to_str().expect("UTF-8")).collect();
        // Files directly in src/models (mod.rs, convert.rs, pull.rs) are in no room.
        if parts.len() < 2 {
            continue;
        }
        let room = parts[0];
        assert!(
            ROOMS.contains(&room),
            "src/models/{room} is not a room: add it to ROOMS"
        );
        let mut module = vec!["models"];
        module.extend(parts.iter().map(|p| p.trim_end_matches(".rs")));
        if module.last() == Some(&"mod") {
            module.pop();
        }
        let code = std::fs::read_to_string(&path).expect("read");
        for later in later_rooms(room, &module, &code) {
            wrong.push(format!(
                "src/models/{} ({room}) imports {later}",
                rel.display()
            ));
        }
        checked += 1;
    }
    assert!(
        checked >= ROOMS.len(),
        "only {checked} files found under {}",
        models.display()
    );
    assert!(
        wrong.is_empty(),
        "rooms import later rooms (order: {}):\n{}",
        ROOMS.join(" < "),
        wrong.join("\n")
    );
}

/// The check itself finds the forms of import it claims to.
#[test]
fn a_later_room_is_found_in_every_form() {
    let arch = ["models", "arch", "config"];
    for code in [
        "use crate::models::runtime::Model;",
        "use crate::models::{arch::Config, text};",
        "pub(crate) fn f(m: &crate::models::blocks::Cache) {}",
        "use super::super::load::Weights;",
        "use crate::models::{\n    arch::{Config, Role},\n    runtime::{Model, Sampler},\n};",
    ] {
        assert_eq!(later_rooms("arch", &arch, code).len(), 1, "{code}");
    }
    // From the room's mod.rs one `super` reaches src/models.
    assert_eq!(
        later_rooms("arch", &["models", "arch"], "use super::text;"),
        ["text"]
    );
    for code in [
        "use crate::models::arch::Config;",
        "use super::role::Role;",
        "// see crate::models::text\nuse super::presets;",
        "fn f() {}\n#[cfg(test)]\nmod tests { use crate::models::text::chat; }",
        "use crate::models::{convert, pull};",
    ] {
        assert!(later_rooms("arch", &arch, code).is_empty(), "{code}");
    }
    let blocks = ["models", "blocks", "kv_cache"];
    assert!(later_rooms(
        "blocks",
        &blocks,
        "use crate::models::{arch, load::Weights};"
    )
    .is_empty());
}
