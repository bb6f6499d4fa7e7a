// C++: operator new, std::vector and std::make_shared reach malloc through
// libstdc++; the names along the stack are demangled (make_shared's
// inlined frames included, whose mangled names the demangler cannot read
// whole), and the call sites are the program's functions, not operator new.
//
// Besides `stack` (the innermost frames of the widget's allocation), it
// states for each function whose code called operator new (the call site
// once the allocator's wrappers are skipped)
//     site <function> <op> <calls> <bytes>
// with bytes `-` where the library decides them (make_shared's block).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace shapes {
struct widget {
    std::vector<int> data;
    __attribute__((noinline)) void grow(int n)
    {
        for (int i = 0; i < n; i++)
            data.push_back(i);
    }
};

__attribute__((noinline)) widget *make_widget(int n)
{
    widget *w = new widget;
    w->grow(n);
    return w;
}

// One block for the vector and the shared count, one for its 16 doubles.
__attribute__((noinline)) std::shared_ptr<std::vector<double>> make_samples(int n)
{
    return std::make_shared<std::vector<double>>(n);
}
} // namespace shapes

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::unique_ptr<shapes::widget> w(shapes::make_widget(100));
    auto samples = shapes::make_samples(16);
    std::printf("cxx: %zu %zu\n", w->data.size(), samples->size());
    std::printf("stack operator new(unsigned long) shapes::make_widget(int) main\n");
    std::printf("site shapes::make_widget(int) malloc 1 %zu\n", sizeof(shapes::widget));
    std::printf("site shapes::make_samples(int) malloc 2 -\n");
    // push_back of 100 ints reallocates for 1, 2, 4, ... 128 elements:
    // from grow once the standard library's frames are wrappers too.
    std::printf("site shapes::widget::grow(int) malloc 8 1020\n");
    return 0;
}
