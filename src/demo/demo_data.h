// `dtune demo`'s synthetic dataset: small PNGs of one coloured shape (circle, square, triangle) on a
// plain background, each with a .txt caption such as "a red circle on a blue background".
//
// Invariants: deterministic (the same count and size give byte-identical files); shape and
// background colours always differ; every caption uses only the words of demo_vocabulary().
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "io/image.h"

namespace dtune::demo {

struct DemoSample {
    std::string shape;       // circle | square | triangle
    std::string color;       // the shape's colour name
    std::string background;  // the background's colour name
    std::string caption() const { return "a " + color + " " + shape + " on a " + background + " background"; }
};

// The i-th sample of the fixed enumeration (cycles through every shape × colour × background).
DemoSample demo_sample(int index);
// Draws a sample: the shape centred, about half the image wide.
io::RgbImage draw_sample(const DemoSample& sample, int size);
// Writes `count` PNGs (shape_<i>.png) and captions (shape_<i>.txt) into `dir`.
std::vector<DemoSample> write_demo_dataset(const std::filesystem::path& dir, int count, int size);
// Every word a caption can contain (for the demo tokenizer).
std::vector<std::string> demo_vocabulary();

}  // namespace dtune::demo
