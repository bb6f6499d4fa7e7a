# The Python workload (programs.rs): N records as dicts, lists and
# strings, indexed, joined, split and sorted. Run with PYTHONMALLOC=malloc
# (every object through malloc) and PYTHONHASHSEED=0, so that every run
# makes the same allocator calls.
import sys

n = int(sys.argv[1])
rows = []
for i in range(n):
    rows.append({"id": i, "name": "item-%d" % i, "tags": [str(i % 7), str(i % 11)]})
index = {row["name"]: row for row in rows}
text = ",".join(row["name"] for row in rows)
words = sorted(text.split(","), key=len)
total = sum(len(row["tags"]) for row in rows)
print(len(index), len(words), total)
