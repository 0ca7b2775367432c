//! The docs hold to the code and to the present:
//!
//! - the "adding an op" section of docs/architecture.md shows the real edits of an op
//!   (`tanh`): every code block there starts with a `// path` comment, and the rest of
//!   the block must appear in that file (ignoring indentation), so the example cannot
//!   drift from the code; the op's family list must name it too, so the tests cover it;
//! - the README, docs, scripts, sources and tests speak of graft and its users, not of
//!   how the work on it was organised (numbered work periods, machines lent, what an
//!   issue or a brief asked);
//! - every relative link in the README and docs/ points to a file that exists, and to a
//!   heading of it where it names one.

use std::path::Path;

use graft::graph::UnaryOp;

/// Code blocks of the section headed `heading` (up to the next `## ` heading) with the
/// path their first line names.
fn blocks(doc: &str, heading: &str) -> Vec<(String, Vec<String>)> {
    let start = doc.find(heading).expect("section present");
    let section = &doc[start + heading.len()..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let mut out = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in section.lines().map(str::trim) {
        match (&mut current, line.starts_with("```")) {
            (None, true) => current = Some(Vec::new()),
            (Some(_), true) => {
                let lines = current.take().expect("open block");
                let path = lines[0].strip_prefix("// ").expect("block names its file");
                out.push((path.to_string(), lines[1..].to_vec()));
            }
            (Some(lines), false) => lines.push(line.to_string()),
            (None, false) => {}
        }
    }
    out
}

#[test]
fn docs_are_honest() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let found = blocks(&doc, "### An elementwise op: four places");
    assert_eq!(found.len(), 4, "the section shows four places");
    for (path, lines) in &found {
        let text = std::fs::read_to_string(root.join(path)).unwrap();
        let code: Vec<&str> = text.lines().map(str::trim).collect();
        let hit = code
            .windows(lines.len())
            .any(|w| w.iter().zip(lines).all(|(a, b)| a == b));
        assert!(
            hit,
            "{path} does not contain the lines the doc shows:\n{lines:#?}"
        );
    }
    assert!(UnaryOp::ALL.contains(&UnaryOp::Tanh));
    assert_eq!(UnaryOp::Tanh.name(), "tanh");
}

/// Text files under `dir` (recursively), skipping `skip` (paths relative to the root).
fn text_files(root: &Path, dir: &str, skip: &[&str], out: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let rel = path.strip_prefix(root).expect("under the root");
        let rel = rel.to_string_lossy().replace('\\', "/");
        if skip.contains(&rel.as_str()) {
            continue;
        }
        if path.is_dir() {
            text_files(root, &rel, skip, out);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            out.push((rel, text));
        }
    }
}

/// The files whose words are checked: the README, a changelog, docs, scripts, sources and
/// tests. Test fixtures are data (vocabularies hold any word), this file holds the
/// phrases it looks for, and the serve client tests' node_modules (npm's, ignored by
/// git) are other projects' code.
fn project_text(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in ["README.md", "CHANGELOG.md", "build.rs"] {
        if let Ok(text) = std::fs::read_to_string(root.join(name)) {
            out.push((name.to_string(), text));
        }
    }
    for dir in ["docs", "scripts", "src", "tests", "cuda", "examples"] {
        text_files(
            root,
            dir,
            &[
                "tests/fixtures",
                "tests/cli/docs.rs",
                "tests/cli/serve_clients/node_modules",
            ],
            &mut out,
        );
    }
    out
}

/// Ordinals as words ("third", "twenty-seventh") or figures ("27th").
fn is_ordinal(w: &str) -> bool {
    const SMALL: [&str; 20] = [
        "first",
        "second",
        "third",
        "fourth",
        "fifth",
        "sixth",
        "seventh",
        "eighth",
        "ninth",
        "tenth",
        "eleventh",
        "twelfth",
        "thirteenth",
        "fourteenth",
        "fifteenth",
        "sixteenth",
        "seventeenth",
        "eighteenth",
        "nineteenth",
        "twentieth",
    ];
    let tens = ["twenty-", "thirty-", "forty-", "fifty-"];
    let w = w.trim_end_matches("'s");
    SMALL.contains(&w)
        || ["thirtieth", "fortieth", "fiftieth"].contains(&w)
        || tens.iter().any(|t| {
            w.strip_prefix(t)
                .is_some_and(|rest| SMALL[..9].contains(&rest))
        })
        || ["st", "nd", "rd", "th"].iter().any(|s| {
            w.strip_suffix(s)
                .is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
        })
}

/// Phrases of `text` that tell how the work was organised rather than what graft is:
/// numbered or named work periods ("the twenty-seventh session", "this session", "a
/// later lease"), machines lent, what an issue or a brief asked, who led. A chat session
/// (`ChatSession`, "a chat session", "one session turn") is a graft feature and passes.
fn organisation_phrases(text: &str) -> Vec<String> {
    let words: Vec<String> = text
        .split(|c: char| !(c.is_alphanumeric() || matches!(c, '-' | '\'' | '#')))
        .filter(|w| !w.is_empty())
        .map(|w| w.to_lowercase().replace('’', "'"))
        .collect();
    let period = |w: &str| {
        let w = w.trim_end_matches("'s");
        matches!(
            w,
            "session" | "sessions" | "lease" | "leases" | "phase" | "phases"
        )
    };
    let mut hits = Vec::new();
    for (i, w) in words.iter().enumerate() {
        let next = words.get(i + 1).map(String::as_str).unwrap_or("");
        let pair = format!("{w} {next}");
        let hit = (is_ordinal(w) && period(next))
            || (matches!(
                w.as_str(),
                "this" | "that" | "same" | "previous" | "next" | "later" | "earlier" | "last"
            ) && period(next))
            || matches!(w.as_str(), "lease" | "leases" | "leased" | "lease's")
            || (w == "issue" && next.trim_start_matches('#').parse::<u32>().is_ok())
            || matches!(
                pair.as_str(),
                "the issue"
                    | "the issues"
                    | "the issue's"
                    | "the brief"
                    | "project's brief"
                    | "brief asks"
                    | "brief asked"
                    | "the lead"
                    | "device tool"
                    | "was lent"
                    | "were lent"
                    | "sessions measured"
                    | "session measured"
            )
            || w.ends_with("issue's");
        if hit {
            hits.push(pair);
        }
    }
    hits
}

#[test]
fn organisation_phrases_are_found() {
    for bad in [
        "the twenty-eighth session measured 231 tok/s",
        "Docs: twenty-seventh session (H200)",
        "as the 9th session found",
        "this session's figures",
        "run in a later lease",
        "the device tool lent only H200s",
        "the quantization issue's 80%",
        "as issue #46 asks",
        "what the brief asks",
        "the lead asked for it",
        "the third phase",
    ] {
        assert!(!organisation_phrases(bad).is_empty(), "not flagged: {bad}");
    }
    for good in [
        "ChatSession holds a conversation; a chat session keeps its cache",
        "the reply of one session turn, and sessions of a chat",
        "Message::new(\"system\", \"Be brief.\")",
        "the release build; please release the plan",
        "the next issue may overwrite it; loads issued before the wait",
        "the leading dimension",
    ] {
        assert_eq!(
            organisation_phrases(good),
            Vec::<String>::new(),
            "flagged: {good}"
        );
    }
}

/// The repository speaks of graft and its users: devices, dates and commits, never of
/// how the work on it was organised.
#[test]
fn docs_and_code_speak_of_the_project() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for (path, text) in project_text(root) {
        for (n, line) in text.lines().enumerate() {
            for phrase in organisation_phrases(line) {
                found.push(format!("{path}:{}: '{phrase}' in: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "phrases about how the work was organised (name the device, date or commit instead):\n{}",
        found.join("\n")
    );
}

/// Lines of markdown outside fenced code blocks.
fn prose_lines(doc: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in doc.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push((n + 1, line));
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings.
fn anchors(doc: &str) -> Vec<String> {
    prose_lines(doc)
        .into_iter()
        .filter_map(|(_, line)| {
            let title = line.trim_start_matches('#');
            (line.starts_with('#') && title.starts_with(' ')).then(|| slug(title))
        })
        .collect()
}

/// The targets of the inline links `[text](target)` of a line.
fn link_targets(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].trim());
        rest = &after[end..];
    }
    out
}

/// Every relative link in the README and docs/ names a file that exists, and a heading
/// of it where the link has an anchor.
#[test]
fn relative_links_resolve() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    let mut listed: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    listed.sort();
    docs.extend(listed);
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let name = doc.strip_prefix(root).unwrap().display().to_string();
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let path = match file {
                    "" => doc.clone(),
                    f => doc.parent().unwrap().join(f),
                };
                if !path.exists() {
                    broken.push(format!("{name}:{n}: {target}: no such file"));
                    continue;
                }
                if anchor.is_empty() || path.extension().is_none_or(|e| e != "md") {
                    continue;
                }
                let target_text = std::fs::read_to_string(&path).unwrap();
                if !anchors(&target_text).iter().any(|a| a == anchor) {
                    broken.push(format!("{name}:{n}: {target}: no heading with that anchor"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: the parser is broken"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug(" Kernels: `graft bench-ops` (H200, 2026-12-01)"),
        "kernels-graft-bench-ops-h200-2026-12-01"
    );
    assert_eq!(slug(" Multi-GPU"), "multi-gpu");
    assert_eq!(
        link_targets("see [a](x.md#b) and [c](../y.rs), not `z`"),
        ["x.md#b", "../y.rs"]
    );
}
