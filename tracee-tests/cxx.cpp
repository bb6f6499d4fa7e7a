// C++: operator new and std::vector reach malloc through libstdc++; the
// names along the stack are demangled.
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
} // namespace shapes

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::unique_ptr<shapes::widget> w(shapes::make_widget(100));
    std::printf("cxx: %zu\n", w->data.size());
    std::printf("stack operator new(unsigned long) shapes::make_widget(int) main\n");
    return 0;
}
