//! What the report writes for other tools: folded stacks, the flame graph
//! and the pprof profile.

use super::*;

#[test]
fn folded_stacks_and_flame_graph() {
    let dir = TempDir::new("flame");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let a = Analysis::full(&trace).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    let lines = flame::folded(&a, &table, Metric::Allocated);
    // Leaves are named after the code that called the allocator: strdup
    // (libc) and operator new are left out; a stack that is all libc stays.
    let expected = [
        ("main", 100),
        ("main;Widget::Widget()", 3000),
        ("main;app+0x2345", 10),
        ("main;push_back;make_node", 224),
        ("puts;_IO_file_doallocate", 4096),
    ];
    let lines: Vec<(&str, u64)> = lines.iter().map(|(s, v)| (s.as_str(), *v)).collect();
    assert_eq!(lines, expected);
    let peak = flame::folded(&a, &table, Metric::Peak);
    assert_eq!(peak.iter().map(|l| l.1).sum::<u64>(), 6334);
    let calls = flame::folded(&a, &table, Metric::Calls);
    assert_eq!(calls.iter().map(|l| l.1).sum::<u64>(), 9);

    let svg = flame::svg(
        &flame::folded(&a, &table, Metric::Leaked),
        Metric::Leaked,
        "t",
    )
    .unwrap();
    let svg = String::from_utf8(svg).unwrap();
    assert!(svg.contains("Widget::Widget() (2,000 bytes"), "{svg}");
    assert!(!svg.contains("operator new"), "{svg}");
    assert!(matches!(
        flame::svg(&[], Metric::Leaked, "t"),
        Err(ReportError::Empty(_))
    ));
}

#[test]
fn pprof_profile_has_the_four_heap_sample_types() {
    use prost::Message;
    let dir = TempDir::new("pprof");
    let trace = open(&write_trace(&dir, &scenario(), true)).unwrap();
    let a = Analysis::full(&trace).unwrap();
    let table = StackTable::load(&trace, &[]).unwrap();
    let profile = pprof::profile(&trace, &a, &table).unwrap();
    let gz = pprof::encode(&profile).unwrap();
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw).unwrap();
    let p = pprof::Profile::decode(&raw[..]).unwrap();
    assert_eq!(p, profile);
    let types: Vec<&str> = p
        .sample_type
        .iter()
        .map(|t| p.string_table[t.r#type as usize].as_str())
        .collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]
    );
    let total = |i: usize| p.sample.iter().map(|s| s.value[i]).sum::<i64>();
    assert_eq!((total(0), total(1), total(2), total(3)), (8, 7430, 3, 6196));
    // Inlined calls are lines of one location, innermost first.
    let make_node = p
        .location
        .iter()
        .find(|l| l.line.len() == 2)
        .expect("the inlined frame");
    let name = |l: &pprof::Line| {
        let f = &p.function[l.function_id as usize - 1];
        p.string_table[f.name as usize].clone()
    };
    assert_eq!(name(&make_node.line[0]), "make_node");
    assert_eq!(name(&make_node.line[1]), "push_back");
    assert_eq!(p.string_table[0], "");
}
