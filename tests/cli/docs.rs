//! The "adding an op" section of docs/architecture.md shows the real edits of an op
//! (`tanh`): every code block there starts with a `// path` comment, and the rest of the
//! block must appear in that file (ignoring indentation), so the example cannot drift
//! from the code. The op's family list must name it too, so the tests cover it.

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
