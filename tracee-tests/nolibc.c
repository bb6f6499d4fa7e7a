/* No C library at all (built -static -nostdlib, then stripped): there is no
 * allocator in it to find, and memptrace must say so and refuse it. */
void _start(void)
{
    __asm__ volatile("mov $60, %eax\n\txor %edi, %edi\n\tsyscall");
}
