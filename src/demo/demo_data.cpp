// The demo's synthetic shapes dataset (see demo_data.h).
#include "demo/demo_data.h"

#include <array>
#include <cmath>
#include <fstream>

#include "core/error.h"

namespace dtune::demo {
namespace {

struct Color {
    const char* name;
    uint8_t r, g, b;
};
constexpr std::array<Color, 6> kColors{{{"red", 220, 40, 40},
                                        {"green", 40, 180, 60},
                                        {"blue", 40, 80, 220},
                                        {"yellow", 240, 220, 40},
                                        {"white", 245, 245, 245},
                                        {"black", 20, 20, 20}}};
constexpr std::array<const char*, 3> kShapes{"circle", "square", "triangle"};

const Color& color(const std::string& name) {
    for (const auto& c : kColors)
        if (name == c.name) return c;
    throw Error(str("unknown demo colour ", name));
}

// Inside test for a shape of half-width `r` centred at (c, c), pixel centre (x, y).
bool inside(const std::string& shape, double x, double y, double c, double r) {
    const double dx = x - c, dy = y - c;
    if (shape == "circle") return dx * dx + dy * dy <= r * r;
    if (shape == "square") return std::fabs(dx) <= r * 0.85 && std::fabs(dy) <= r * 0.85;
    // Upward triangle: apex at (c, c - r), base at y = c + r.
    if (dy < -r || dy > r) return false;
    return std::fabs(dx) <= (dy + r) / 2.0 * 1.1;
}

}  // namespace

DemoSample demo_sample(int index) {
    // All 3 shapes x 6 colours x 5 other backgrounds = 90 combinations, visited with a stride
    // coprime to 90 so that any short prefix mixes shapes, colours and backgrounds.
    const int n = static_cast<int>(kColors.size()), total = 3 * n * (n - 1);
    int k = ((index % total) * 37) % total;
    const int shape = k % 3;
    k /= 3;
    const int col = k % n;
    int bg = (k / n) % (n - 1);
    if (bg >= col) ++bg;
    return {kShapes[static_cast<size_t>(shape)], kColors[static_cast<size_t>(col)].name,
            kColors[static_cast<size_t>(bg)].name};
}

io::RgbImage draw_sample(const DemoSample& s, int size) {
    io::RgbImage im(size, size);
    const Color& fg = color(s.color);
    const Color& bg = color(s.background);
    const double c = size / 2.0, r = size * 0.28;
    for (int y = 0; y < size; ++y) {
        uint8_t* row = im.row(y);
        for (int x = 0; x < size; ++x) {
            // 4x supersampling for smooth edges.
            int hits = 0;
            for (int sy = 0; sy < 2; ++sy)
                for (int sx = 0; sx < 2; ++sx)
                    hits += inside(s.shape, x + 0.25 + 0.5 * sx, y + 0.25 + 0.5 * sy, c, r);
            const double a = hits / 4.0;
            row[3 * x + 0] = static_cast<uint8_t>(std::lround(fg.r * a + bg.r * (1 - a)));
            row[3 * x + 1] = static_cast<uint8_t>(std::lround(fg.g * a + bg.g * (1 - a)));
            row[3 * x + 2] = static_cast<uint8_t>(std::lround(fg.b * a + bg.b * (1 - a)));
        }
    }
    return im;
}

std::vector<DemoSample> write_demo_dataset(const std::filesystem::path& dir, int count, int size) {
    std::filesystem::create_directories(dir);
    std::vector<DemoSample> out;
    for (int i = 0; i < count; ++i) {
        const DemoSample s = demo_sample(i);
        io::write_image(dir / str("shape_", i, ".png"), draw_sample(s, size));
        std::ofstream(dir / str("shape_", i, ".txt")) << s.caption() << "\n";
        out.push_back(s);
    }
    return out;
}

std::vector<std::string> demo_vocabulary() {
    std::vector<std::string> words{"a", "on", "background"};
    for (const char* s : kShapes) words.emplace_back(s);
    for (const auto& c : kColors) words.emplace_back(c.name);
    return words;
}

}  // namespace dtune::demo
