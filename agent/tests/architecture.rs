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
            let rest = &code[i + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() && name != module {
                deps.insert(name);
            }
        }
    }
    graph
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
