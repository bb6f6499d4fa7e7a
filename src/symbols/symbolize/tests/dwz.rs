//! Debug information moved by `dwz` into a supplementary file that
//! several debug files share.

use super::*;

const SHARED_H: &str = include_str!("../fixtures/shared.h");

fn dwz_user(name: &str) -> String {
    format!(
        r#"#include "shared.h"
__attribute__((noinline)) struct record *build_{name}(long id) {{
    struct record *r = make_record(id * 7); /* INLINE SITE */
    r->weight = 1.5;
    return r;
}}
int main(int argc, char **argv) {{ (void)argv; return build_{name}(argc)->id == 3; }}
"#
    )
}

/// Debian's `-dbgsym` packages are compressed with `dwz -m`: DWARF shared by
/// several files moves to one supplementary file that `.gnu_debugaltlink`
/// names. Here the inlined function's DIE moves there.
#[test]
fn reads_dwz_supplementary_files() {
    assert!(
        Command::new("dwz").arg("--version").output().is_ok(),
        "dwz is not installed (scripts/deps installs it)"
    );
    let dir = TempDir::new("dwz");
    std::fs::write(dir.path("shared.h"), SHARED_H).unwrap();
    for name in ["a", "b"] {
        build(
            &dir,
            "gcc",
            &format!("{name}.c"),
            &dwz_user(name),
            &["-g", "-O2"],
            name,
        );
    }
    let binary = dir.path("a");
    let probe = first_call_in(&binary, "build_a");
    run("dwz", &["-m", "common.debug", "a", "b"], &dir.0);

    let expected = |lines: &[SourceLine]| {
        let functions: Vec<_> = lines.iter().map(|l| l.function.as_deref()).collect();
        assert_eq!(
            functions,
            [Some("make_record"), Some("build_a")],
            "{lines:?}"
        );
        assert_eq!(lines[0].line, Some(line_of(SHARED_H, "CALL malloc")));
        assert_eq!(file_name(&lines[0]), Some("shared.h"));
    };
    // The link's relative path, from the file's directory.
    expected(&one(
        &mut Symbolizer::with_debug_roots(vec![]),
        &binary,
        probe,
    ));

    // By the supplementary file's build-id under a debug root.
    let sup_id = build_id_of(&dir.path("common.debug"));
    let root = dir.path("debug-root");
    let placed = root.join(".build-id").join(&sup_id[..2]);
    std::fs::create_dir_all(&placed).unwrap();
    std::fs::rename(
        dir.path("common.debug"),
        placed.join(format!("{}.debug", &sup_id[2..])),
    )
    .unwrap();
    expected(&one(
        &mut Symbolizer::with_debug_roots(vec![root]),
        &binary,
        probe,
    ));

    // Without it, the inlined function has no name, the rest still works.
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0].function, None);
    assert_eq!(lines[0].line, Some(line_of(SHARED_H, "CALL malloc")));
    assert_eq!(lines[1].function.as_deref(), Some("build_a"));
}
