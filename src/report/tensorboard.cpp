// TensorBoard event files (see tensorboard.h for the format and invariants).
#include "report/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/append_log.h"
#include "core/error.h"

namespace dtune::report {
namespace {

std::array<uint32_t, 256> make_crc_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;  // reflected 0x1EDC6F41
        t[i] = c;
    }
    return t;
}

// --- protobuf wire format (varint, 64-bit, length-delimited, 32-bit) ---
void put_varint(std::string& out, uint64_t v) {
    while (v >= 0x80) {
        out.push_back(static_cast<char>((v & 0x7f) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, int field, int wire) {
    put_varint(out, (static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire));
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
    put_tag(out, field, 2);
    put_varint(out, bytes.size());
    out.append(bytes);
}
template <typename T>
void put_fixed(std::string& out, int field, T value) {
    put_tag(out, field, sizeof(T) == 8 ? 1 : 5);
    char b[sizeof(T)];
    std::memcpy(b, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
    out.append(b, sizeof(T));
}
void put_u64_le(std::string& out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u32_le(std::string& out, uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A cursor over protobuf bytes; every read checks bounds and names `where` on failure.
struct Reader {
    std::string_view data;
    const std::string& where;
    size_t pos = 0;

    bool done() const { return pos >= data.size(); }
    [[noreturn]] void fail(const char* what) const {
        throw DataError(str(where, ": malformed protobuf (", what, " at byte ", pos,
                            "); the event file is damaged, delete it or rewrite the run's logs"));
    }
    uint64_t varint() {
        uint64_t v = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            if (pos >= data.size()) fail("truncated varint");
            const auto b = static_cast<uint8_t>(data[pos++]);
            v |= static_cast<uint64_t>(b & 0x7f) << shift;
            if (!(b & 0x80)) return v;
        }
        fail("varint too long");
    }
    std::string_view bytes() {
        const uint64_t n = varint();
        if (n > data.size() - pos) fail("length past the end");
        const auto s = data.substr(pos, n);
        pos += n;
        return s;
    }
    template <typename T>
    T fixed() {
        if (data.size() - pos < sizeof(T)) fail("truncated fixed field");
        T v;
        std::memcpy(&v, data.data() + pos, sizeof(T));
        pos += sizeof(T);
        return v;
    }
    void skip(int wire) {
        if (wire == 0)
            varint();
        else if (wire == 1)
            fixed<uint64_t>();
        else if (wire == 2)
            bytes();
        else if (wire == 5)
            fixed<uint32_t>();
        else
            fail("unsupported wire type");
    }
};

std::string encode_image(const ImageSummary& im) {
    std::string out;
    put_tag(out, 1, 0), put_varint(out, static_cast<uint64_t>(im.height));
    put_tag(out, 2, 0), put_varint(out, static_cast<uint64_t>(im.width));
    put_tag(out, 3, 0), put_varint(out, static_cast<uint64_t>(im.colorspace));
    put_bytes(out, 4, im.png);
    return out;
}

ImageSummary decode_image(std::string_view bytes, const std::string& where) {
    Reader r{bytes, where};
    ImageSummary im;
    while (!r.done()) {
        const uint64_t key = r.varint();
        const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
        if (field == 1 && wire == 0)
            im.height = static_cast<int>(r.varint());
        else if (field == 2 && wire == 0)
            im.width = static_cast<int>(r.varint());
        else if (field == 3 && wire == 0)
            im.colorspace = static_cast<int>(r.varint());
        else if (field == 4 && wire == 2)
            im.png = std::string(r.bytes());
        else
            r.skip(wire);
    }
    return im;
}

Event::Value decode_value(std::string_view bytes, const std::string& where) {
    Reader r{bytes, where};
    Event::Value v;
    while (!r.done()) {
        const uint64_t key = r.varint();
        const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
        if (field == 1 && wire == 2)
            v.tag = std::string(r.bytes());
        else if (field == 2 && wire == 5)
            v.simple_value = r.fixed<float>();
        else if (field == 4 && wire == 2)
            v.image = decode_image(r.bytes(), where);
        else
            r.skip(wire);
    }
    return v;
}

}  // namespace

uint32_t crc32c(std::string_view data) {
    static const auto table = make_crc_table();
    uint32_t c = 0xffffffffu;
    for (const char ch : data) c = table[(c ^ static_cast<uint8_t>(ch)) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
    const uint32_t c = crc32c(data);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_record(std::string_view payload) {
    std::string len;
    put_u64_le(len, payload.size());
    std::string out = len;
    put_u32_le(out, masked_crc32c(len));
    out.append(payload);
    put_u32_le(out, masked_crc32c(payload));
    return out;
}

std::string encode_event(const Event& e) {
    std::string out;
    put_fixed<double>(out, 1, e.wall_time);
    put_tag(out, 2, 0), put_varint(out, static_cast<uint64_t>(e.step));
    if (!e.file_version.empty()) put_bytes(out, 3, e.file_version);
    if (!e.values.empty()) {
        std::string summary;
        for (const auto& v : e.values) {
            std::string value;
            put_bytes(value, 1, v.tag);
            if (v.simple_value) put_fixed<float>(value, 2, *v.simple_value);
            if (v.image) put_bytes(value, 4, encode_image(*v.image));
            put_bytes(summary, 1, value);
        }
        put_bytes(out, 5, summary);
    }
    return out;
}

Event decode_event(std::string_view bytes, const std::string& where) {
    Reader r{bytes, where};
    Event e;
    while (!r.done()) {
        const uint64_t key = r.varint();
        const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
        if (field == 1 && wire == 1) {
            e.wall_time = r.fixed<double>();
        } else if (field == 2 && wire == 0) {
            e.step = static_cast<int64_t>(r.varint());
        } else if (field == 3 && wire == 2) {
            e.file_version = std::string(r.bytes());
        } else if (field == 5 && wire == 2) {
            Reader s{r.bytes(), where};
            while (!s.done()) {
                const uint64_t k = s.varint();
                if ((k >> 3) == 1 && (k & 7) == 2)
                    e.values.push_back(decode_value(s.bytes(), where));
                else
                    s.skip(static_cast<int>(k & 7));
            }
        } else {
            r.skip(wire);
        }
    }
    return e;
}

namespace {
double now_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

EventWriter::EventWriter(const std::filesystem::path& dir) {
    std::filesystem::create_directories(dir);
    char host[256] = "localhost";
    gethostname(host, sizeof(host) - 1);
    const auto t = static_cast<int64_t>(now_seconds());
    path_ = dir / str("events.out.tfevents.", t, ".", host, ".", getpid(), ".dtune");
    log_ = std::make_unique<fs::AppendLog>(path_);
    Event first;
    first.wall_time = now_seconds();
    first.file_version = "brain.Event:2";
    write(first);
}

EventWriter::~EventWriter() = default;

void EventWriter::write(const Event& event) {
    log_->append(frame_record(encode_event(event)));
}

std::size_t EventWriter::held() const {
    return log_->held();
}

const std::string& EventWriter::error() const {
    return log_->error();
}

bool EventWriter::retry() {
    return log_->retry();
}

void EventWriter::add_scalar(const std::string& tag, double value, int64_t step) {
    Event e;
    e.wall_time = now_seconds();
    e.step = step;
    e.values.push_back({tag, static_cast<float>(value), std::nullopt});
    write(e);
}

void EventWriter::add_image(const std::string& tag, const ImageSummary& image, int64_t step) {
    Event e;
    e.wall_time = now_seconds();
    e.step = step;
    e.values.push_back({tag, std::nullopt, image});
    write(e);
}

std::vector<Event> read_events(const std::filesystem::path& file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw DataError(str("cannot read ", file.string(), "; check the path"));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string data = ss.str();
    std::vector<Event> events;
    size_t pos = 0;
    while (data.size() - pos >= 12) {
        const std::string_view len_bytes(data.data() + pos, 8);
        uint64_t len = 0;
        for (int i = 0; i < 8; ++i)
            len |= static_cast<uint64_t>(static_cast<uint8_t>(len_bytes[i])) << (8 * i);
        uint32_t len_crc = 0;
        std::memcpy(&len_crc, data.data() + pos + 8, 4);
        if (len_crc != masked_crc32c(len_bytes))
            throw DataError(str(file.string(), ": bad length CRC at offset ", pos, "; the file is damaged"));
        if (data.size() - pos - 12 < len + 4) break;  // a partial final record
        const std::string_view payload(data.data() + pos + 12, len);
        uint32_t crc = 0;
        std::memcpy(&crc, data.data() + pos + 12 + len, 4);
        if (crc != masked_crc32c(payload))
            throw DataError(str(file.string(), ": bad data CRC at offset ", pos, "; the file is damaged"));
        events.push_back(decode_event(payload, str(file.string(), " at offset ", pos)));
        pos += 12 + len + 4;
    }
    return events;
}

}  // namespace dtune::report
