// Minimal XML extraction for S3 responses. See s3_xml.h.
#include "io/s3_xml.h"

#include <cstdlib>

namespace dtune::io::s3xml {
namespace {

void append_utf8(std::string& out, unsigned long cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

}  // namespace

std::vector<std::string_view> all(std::string_view xml, std::string_view tag) {
    std::vector<std::string_view> out;
    const std::string open = "<" + std::string(tag), close = "</" + std::string(tag) + ">";
    std::size_t pos = 0;
    while ((pos = xml.find(open, pos)) != std::string_view::npos) {
        const std::size_t after = pos + open.size();
        // "<Key>" or "<Key attr=...>", not "<KeyMarker>"; "<Key/>" is an empty element.
        if (after >= xml.size() || (xml[after] != '>' && xml[after] != ' ' && xml[after] != '/')) {
            pos = after;
            continue;
        }
        const std::size_t gt = xml.find('>', after);
        if (gt == std::string_view::npos) break;
        if (xml[gt - 1] == '/') {
            out.emplace_back();
            pos = gt + 1;
            continue;
        }
        const std::size_t end = xml.find(close, gt + 1);
        if (end == std::string_view::npos) break;
        out.push_back(xml.substr(gt + 1, end - gt - 1));
        pos = end + close.size();
    }
    return out;
}

std::string first(std::string_view xml, std::string_view tag) {
    const auto found = all(xml, tag);
    return found.empty() ? std::string() : decode(found.front());
}

std::string decode(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
        const std::size_t semi = text[i] == '&' ? text.find(';', i) : std::string_view::npos;
        if (semi == std::string_view::npos || semi - i > 10) {
            out += text[i];
            continue;
        }
        const std::string_view ent = text.substr(i + 1, semi - i - 1);
        if (ent == "amp")
            out += '&';
        else if (ent == "lt")
            out += '<';
        else if (ent == "gt")
            out += '>';
        else if (ent == "quot")
            out += '"';
        else if (ent == "apos")
            out += '\'';
        else if (!ent.empty() && ent[0] == '#') {
            const std::string num(ent.substr(1));
            const bool hex = !num.empty() && (num[0] == 'x' || num[0] == 'X');
            append_utf8(out, std::strtoul(num.c_str() + (hex ? 1 : 0), nullptr, hex ? 16 : 10));
        } else {
            out.append(text.substr(i, semi - i + 1));
        }
        i = semi;
    }
    return out;
}

std::string escape(std::string_view text) {
    std::string out;
    for (char c : text) {
        switch (c) {
            case '&': out += "&amp;"; break;
            case '<': out += "&lt;"; break;
            case '>': out += "&gt;"; break;
            case '"': out += "&quot;"; break;
            default: out += c;
        }
    }
    return out;
}

}  // namespace dtune::io::s3xml
