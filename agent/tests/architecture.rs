//! The agent's modules depend on each other in one direction: no cycle among the top-level modules
//! of `agent/src` (`config`, `export`, `tail`, ...). Read from the sources: a `crate::NAME` path
//! outside a file's test module is a dependency of that file's top-level module on `NAME`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn top_level_module(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_owned())
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(module) = top_level_module(&src, &file) else { continue };
        let text = std::fs::read_to_string(&file).unwrap();
        // Test modules sit at the end of a file; what they use is not the module's dependency.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let deps = graph.entry(module.clone()).or_default();
        for (i, _) in code.match_indices("crate::") {
            for name in referenced_modules(&code[i + "crate::".len()..]) {
                if name != module {
                    deps.insert(name);
                }
            }
        }
    }
    graph
}

/// The top-level modules named right after a `crate::`: one (`crate::a::b`), or each first segment
/// of a group (`crate::{a::b, c}`).
fn referenced_modules(after: &str) -> Vec<String> {
    let ident =
        |s: &str| -> String { s.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect() };
    let Some(group) = after.strip_prefix('{') else {
        return vec![ident(after)].into_iter().filter(|n| !n.is_empty()).collect();
    };
    // Split the group's top level at commas (nested groups belong to their first segment).
    let (mut names, mut depth, mut start) = (Vec::new(), 0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                names.push(ident(&group[start..i]));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                names.push(ident(&group[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    names.into_iter().filter(|n| !n.is_empty()).collect()
}

/// A cycle through `from`, as the list of modules on it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, from: &str) -> Option<Vec<String>> {
    if let Some(start) = path.iter().position(|m| m == from) {
        let mut found = path[start..].to_vec();
        found.push(from.to_owned());
        return Some(found);
    }
    path.push(from.to_owned());
    for next in graph.get(from).into_iter().flatten() {
        if let Some(found) = cycle(graph, path, next) {
            return Some(found);
        }
    }
    path.pop();
    None
}

#[test]
fn grouped_paths_name_each_module() {
    assert_eq!(referenced_modules("config::Config;"), ["config"]);
    assert_eq!(referenced_modules("{config::{A, B}, export, tail::x};"), ["config", "export", "tail"]);
}

#[test]
fn the_agents_modules_have_no_dependency_cycle() {
    let graph = dependencies();
    // The reading works: modules known to depend on others are seen doing so.
    assert!(graph["config"].contains("export"), "{graph:?}");
    assert!(graph["tail"].contains("pipeline"), "{graph:?}");
    for module in graph.keys() {
        if let Some(found) = cycle(&graph, &mut Vec::new(), module) {
            panic!("module dependency cycle: {}", found.join(" -> "));
        }
    }
}
